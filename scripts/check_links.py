#!/usr/bin/env python3
"""Every cross-reference in the docs and the code resolves (ctest kvq:doc_links).

Checks, over the tracked Markdown files and the C++, CUDA, Python and CMake sources:
  - relative Markdown links `[text](path)` and `[text](path#anchor)`: the file exists and, for a
    Markdown target, the anchor is one of its headings (GitHub's slugs: lower case, punctuation
    but '-' and '_' dropped, spaces to '-', a repeated slug numbered -1, -2, ...);
  - in-page links `[text](#anchor)`;
  - cited sections `<file>.md, "<Section>"` or `<file>.md "<Section>"` (docs/ when the path has no
    folder): the file has a heading that starts with the section's words, or a bold run-in label
    (`**<Section>...`) that does.
Prints each broken reference as file:line and exits 1 when there is one.

    python3 scripts/check_links.py [repo root]
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
SOURCES = (".md", ".hpp", ".cpp", ".cuh", ".cu", ".py", ".txt", ".cmake", ".sh")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITE = re.compile(r"([\w./-]*\.md),? \"([^\"]+)\"")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def slug(text):
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def outline(path, cache={}):
    """A Markdown file's heading slugs and the lower-cased texts of its headings and bold labels."""
    if path not in cache:
        slugs, texts, seen, fenced = set(), [], {}, False
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            m = HEADING.match(line)
            if m:
                base = slug(m.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                slugs.add(base if n == 0 else f"{base}-{n}")
                texts.append(re.sub(r"[`*]", "", m.group(1)).lower())
            for b in re.findall(r"\*\*([^*]+)\*\*", line):
                texts.append(re.sub(r"`", "", b).lower())
        cache[path] = (slugs, texts)
    return cache[path]


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if p.endswith(SOURCES) and (ROOT / p).is_file()]


def main():
    problems = []
    for path in tracked():
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(ROOT)
        markdown = path.suffix == ".md"
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{lineno}"
            if markdown:
                for target in LINK.findall(line):
                    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                        continue
                    file, _, anchor = target.partition("#")
                    dest = (path.parent / file).resolve() if file else path
                    if not dest.exists():
                        problems.append(f"{where}: link to {target}: no file {file}")
                    elif anchor and dest.suffix == ".md" and anchor not in outline(dest)[0]:
                        problems.append(f"{where}: link to {target}: {dest.relative_to(ROOT)} has no heading #{anchor}")
            for file, section in CITE.findall(line):
                name = pathlib.Path(file)
                if name.name in ("a.md", ".md") or not name.stem:
                    continue
                candidates = [path.parent / name, ROOT / name, ROOT / "docs" / name.name]
                dest = next((c for c in candidates if c.is_file()), None)
                if dest is None:
                    problems.append(f"{where}: cites {file}, which does not exist")
                    continue
                want = re.sub(r"[`*]", "", section).lower()
                if not any(t.startswith(want) for t in outline(dest)[1]):
                    problems.append(f"{where}: cites {file}, \"{section}\": no such section")
    for p in problems:
        print(p)
    print(f"check_links: {len(problems)} broken reference(s)" if problems else "check_links: every reference resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Extracts Jane Austen novels from Debian's r-cran-janeaustenr package into plain text.

The package keeps each novel as an R character vector (one element per line of the Project
Gutenberg text) in an R lazy-load database (data/Rdata.rdx: gzip'd serialized index of
name -> (offset, length); data/Rdata.rdb: per object a 4-byte big-endian length and a zlib
stream of the serialized object). This script reads that format with a small R-serialization
(XDR, version 2/3) reader, so neither R nor any PyPI package is needed.

Usage:
  apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb pkg
  extract_austen.py pkg/usr/lib/R/site-library/janeaustenr/data OUT_DIR [--split [--haystack-chapters N]]

Without --split it writes every novel to OUT_DIR/<name>.txt. With --split it writes kvq-eval's
data files (see data/eval/README.md): the evaluation split (Persuasion, chapters 1-3), the needle
haystack (Sense and Sensibility, chapters 1-N, N = --haystack-chapters, default 6: enough for
needle prompts of 8,192 SmolLM2 tokens) and the calibration split (Emma, chapters 1-3).
"""
import gzip
import re
import struct
import sys
import zlib
from pathlib import Path


class RReader:
    """Minimal reader of R's XDR serialization: enough for lists, vectors and strings."""

    NILVALUE, REFSXP, GLOBALENV, UNBOUND, MISSINGARG, BASENAMESPACE = 254, 255, 253, 252, 251, 250
    EMPTYENV, BASEENV = 242, 241

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization (expected 'X\\n')")
        self.d, self.p, self.refs = data, 2, []
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name
        elif version != 2:
            raise ValueError(f"R serialization version {version} is not supported")

    def int(self):
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t in (self.NILVALUE, self.GLOBALENV, self.UNBOUND, self.MISSINGARG, self.BASENAMESPACE,
                 self.EMPTYENV, self.BASEENV):
            return None
        if t == self.REFSXP:
            idx = flags >> 8 if flags >> 8 else self.int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(("sym", name))
            return ("sym", name)
        if t in (2, 6, 17):  # LISTSXP, LANGSXP, DOTSXP: pairlist node
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            node = [(tag[1] if tag else None, car)]  # attributes of a pairlist node are not needed
            if isinstance(cdr, list):
                node.extend(cdr)
            return node
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.d[self.p:self.p + n].decode("utf-8", errors="replace")
            self.p += n
            return s
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            v = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.int()
            v = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
        elif t == 16:  # STRSXP
            n = self.int()
            v = [self.item() for _ in range(n)]
        elif t in (19, 20):  # VECSXP, EXPRSXP
            n = self.int()
            v = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"R object type {t} is not supported by this reader")
        attrs = self.item() if has_attr else None
        if attrs:
            names = dict(attrs).get("names")
            if names and len(names) == len(v):
                return dict(zip(names, v))
        return v


def read_lazyload(data_dir: Path):
    """Returns {name: value} for every object of an R lazy-load database (Rdata.rdx/rdb)."""
    raw = (data_dir / "Rdata.rdx").read_bytes()
    # R writes the index gzip'd (magic 1f 8b); older versions a 4-byte length + zlib stream.
    index = RReader(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])).item()
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset:offset + length]
        out[name] = RReader(zlib.decompress(blob[4:])).item()
    return out


def chapters(lines, first, last):
    """Text of chapters first..last (1-based), paragraphs joined into single lines."""
    text = "\n".join(l or "" for l in lines)
    heads = [m.start() for m in re.finditer(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?\s*$", text, re.M)]
    if len(heads) < last:
        raise ValueError(f"only {len(heads)} chapter headings found, need {last}")
    end = heads[last] if last < len(heads) else len(text)
    body = text[heads[first - 1]:end]
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body)]
    return "\n\n".join(p for p in paras if p) + "\n"


HAYSTACK_CHAPTERS = 6


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    haystack_chapters = HAYSTACK_CHAPTERS
    if "--haystack-chapters" in argv:
        i = argv.index("--haystack-chapters")
        if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
            print("--haystack-chapters needs a positive number of chapters", file=sys.stderr)
            return 2
        haystack_chapters = int(argv[i + 1])
    novels = read_lazyload(Path(argv[1]))
    out = Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if "--split" not in argv:
        for name, lines in novels.items():
            if isinstance(lines, list) and all(isinstance(l, (str, type(None))) for l in lines):
                (out / f"{name}.txt").write_text("\n".join(l or "" for l in lines) + "\n", encoding="utf-8")
        return 0
    (out / "eval_persuasion.txt").write_text(chapters(novels["persuasion"], 1, 3), encoding="utf-8")
    (out / "haystack_sense_and_sensibility.txt").write_text(chapters(novels["sensesensibility"], 1, haystack_chapters),
                                                            encoding="utf-8")
    (out / "calib_emma.txt").write_text(chapters(novels["emma"], 1, 3), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Writes kvq-eval's legal-prose evaluation text from the license texts of Debian's base-files.

The texts are copied verbatim (bytes unchanged) and joined with one blank line, in the order
given. Each text must state that verbatim copies of it may be distributed (the FSF licenses
do: "Everyone is permitted to copy and distribute verbatim copies of this license document,
but changing it is not allowed."); a text without that statement is refused, so the output is
always redistributable. See data/eval/README.md.

Usage:
  extract_licenses.py OUT_FILE [LICENSE_DIR]
LICENSE_DIR defaults to /usr/share/common-licenses (package base-files).
"""
import hashlib
import sys
from pathlib import Path

# Order of the texts in the output; all three carry the FSF's verbatim-copying statement.
TEXTS = ["GPL-3", "GFDL-1.3", "LGPL-2.1"]
PERMISSION = "Everyone is permitted to copy and distribute verbatim copies"


def main(argv):
    if len(argv) not in (2, 3):
        sys.stderr.write(__doc__)
        return 2
    out = Path(argv[1])
    src = Path(argv[2]) if len(argv) == 3 else Path("/usr/share/common-licenses")
    parts = []
    for name in TEXTS:
        path = src / name
        if not path.is_file():
            sys.stderr.write(f"extract_licenses.py: {path} does not exist (is base-files installed?)\n")
            return 1
        text = path.read_text(encoding="utf-8")
        if PERMISSION not in " ".join(text.split()):
            sys.stderr.write(f"extract_licenses.py: {path} does not permit verbatim copies ('{PERMISSION}')\n")
            return 1
        parts.append(text.rstrip("\n") + "\n")
    data = "\n".join(parts).encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(f"{out}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Tests of scripts/long_context_report.py on a small hand-made kvq-eval record (standard library only).

usage: test_long_context_report.py   (exits non-zero on a failure; ctest eval:scripts)
"""
import importlib.util
import math
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("lcr", HERE.parent / "scripts" / "long_context_report.py")
lcr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lcr)


def bucket(first, end, kl, top1, dppl, ppl=3.0):
    return {"first": first, "end": end, "positions": 10, "mean_kl": kl, "top1_agreement": top1,
            "perplexity": ppl, "perplexity_delta": dppl}


def config(name, ref, kls, results):
    return {
        "name": name, "reference": ref, "bits": {"total_bits": 16.0 if ref else 4.5},
        "quality": {"mean_kl": 0.0 if ref else 0.02, "top1_agreement": 1.0 if ref else 0.97,
                    "perplexity": 3.0, "perplexity_delta": 0.0 if ref else 0.05},
        "kl_by_position": {"bucket": 512, "first_position": 256, "mean_kl": kls},
        "position_buckets": [bucket(0, 512, 0 if ref else 0.01, 1.0 if ref else 0.99, 0.0 if ref else 0.01),
                             bucket(512, 1024, 0 if ref else 0.03, 1.0 if ref else 0.95, 0.0 if ref else 0.08)],
        "needle": {"results": results},
    }


def result(ctx, ok, kind=None, done=True):
    r = {"context": ctx, "pass": ok, "done": done}
    if kind:
        r["kind"] = kind
    return r


def record():
    fp16 = [result(1024, True), result(1024, True), result(2048, False), result(1024, True, "multi")]
    kivi = [result(1024, True), result(1024, False), result(2048, True), result(1024, False, "multi"),
            result(2048, True, done=False)]  # not run yet: not counted
    return {
        "kind": "kvq.eval", "command": "kvq-eval -m m.gguf",
        "text": {"path": "data/eval/eval_legal.txt", "positions": [256, 1279]},
        "needle": {"haystack_path": "data/eval/haystack.txt"},
        "configs": [config("fp16", True, [0, 0], fp16), config("kivi2/g32", False, [0.01, 0.03], kivi),
                    config("<odd>", False, [0.002, None], [])],
    }


class LongContextReport(unittest.TestCase):
    def test_markdown_tables(self):
        md = lcr.render_md([record()])
        self.assertIn("| configuration | bits/el | KL 0-512 | KL 512-1K | KL all | top-1 all | top-1 512-1K "
                      "| ΔPPL all | ΔPPL 512-1K |", md)
        self.assertIn("| `kivi2/g32` | 4.50 | 1.00e-02 | 3.00e-02 | 2.00e-02 | 0.9700 | 0.9500 | +0.050 | +0.080 |",
                      md)
        # needle: single-key before multi-key, FP16's row first; the unfinished trial is not counted
        self.assertIn("| configuration | single-key 1K | single-key 2K | multi-key 1K |", md)
        self.assertIn("| `fp16` (reference) | 2/2 | 0/1 | 1/1 |", md)
        # a pass where FP16 failed counts in the rate but not in brackets
        self.assertIn("| `kivi2/g32` | 1/2 (1/2) | 1/1 (0/0) | 0/1 (0/1) |", md)
        self.assertIn("| `<odd>` | - | - | - |", md)
        self.assertLess(md.index("(reference)"), md.index("| `kivi2/g32` | 1/2"))
        self.assertIn("eval_legal.txt, positions 256..1279", md)

    def test_svg_is_standalone_with_a_line_per_config(self):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "kl.svg"
            self.assertEqual(lcr.main([self._write(d, record()), "--svg", str(out), "--md", str(Path(d) / "t.md")]),
                             0)
            svg = out.read_text(encoding="utf-8")
        root = ET.fromstring(svg)  # well-formed XML; names are escaped
        ns = "{http://www.w3.org/2000/svg}"
        lines = root.findall(f"{ns}polyline")
        self.assertEqual(len(lines), 2)  # the reference (KL 0) has no line
        for bad in ("<script", "href=", "url("):
            self.assertNotIn(bad, svg)
        self.assertIn("&lt;odd&gt;", svg)
        self.assertIn(">1e-3<", svg)  # log axis labels by decade
        # log axis: kivi2's points 0.01 and 0.03 lie log10(3) decades apart
        pts = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
        ys = {t.text: float(t.get("y")) for t in root.findall(f"{ns}text") if t.text and t.text.startswith("1e")}
        decade = ys["1e-2"] - ys["1e-1"]
        self.assertAlmostEqual(pts[0][1] - pts[1][1], decade * math.log10(3), places=0)
        self.assertLess(pts[0][0], pts[1][0])

    def test_bits_svg_has_a_point_per_config_rotated_in_red(self):
        rec = record()
        rot = config("kivi2/g32+rot", False, [0.005, 0.01], [])
        rot["quality"]["mean_kl"] = 0.002
        rec["configs"].append(rot)
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "bits.svg"
            self.assertEqual(lcr.main([self._write(d, rec), "--bits-svg", str(out), "--md", str(Path(d) / "t.md")]), 0)
            svg = out.read_text(encoding="utf-8")
        root = ET.fromstring(svg)
        ns = "{http://www.w3.org/2000/svg}"
        dots = root.findall(f"{ns}circle")
        self.assertEqual(len(dots), 3)  # every configuration but the reference
        fills = [c.get("fill") for c in dots]
        self.assertEqual(fills.count(lcr.PALETTE[1]), 1)  # the rotated one
        self.assertEqual([lcr.suffix_color(n) for n in ("kivi2/g32", "kivi2/g32+rot", "kivi2/g32+sink",
                                                         "kivi2/g32+rot+sink2", "kivi2/g32+sink+rot")],
                         [lcr.PALETTE[0], lcr.PALETTE[1], lcr.PALETTE[3], lcr.PALETTE[4], lcr.PALETTE[4]])
        # log axis: mean KL 0.02 (kivi2, <odd>) sits log10(10) = one decade above 0.002 (rotated)
        ys = {t.text: float(t.get("y")) for t in root.findall(f"{ns}text") if t.text and t.text.startswith("1e")}
        decade = ys["1e-3"] - ys["1e-2"]
        self.assertAlmostEqual(float(dots[2].get("cy")) - float(dots[0].get("cy")), decade, places=0)
        self.assertIn("&lt;odd&gt;", svg)

    def test_peer_points_and_table(self):
        rec = record()
        rec["cache"] = {"page_tokens": 32, "window": 32, "recent": 0}
        peer = {"peer": "llama.cpp", "version": "0.3.36", "text": "/elsewhere/eval_legal.txt", "configs": [
            {"cache": "q4_0", "type": "q4_0", "rotation": True, "bits_per_element": 4.5, "mean_kl": 0.06,
             "p99_kl": 0.5, "top1_agreement": 0.88, "delta_ppl": 0.9},
            {"cache": "q8_0:norot", "type": "q8_0", "rotation": False, "bits_per_element": 8.5, "mean_kl": 0.001,
             "p99_kl": 0.01, "top1_agreement": 0.99, "delta_ppl": 0.01}]}
        other = dict(peer, text="data/eval/other.txt")  # another text: neither plotted nor tabled
        with tempfile.TemporaryDirectory() as d:
            run = self._write(d, rec)
            pp, po = Path(d) / "peer.json", Path(d) / "other.json"
            import json
            pp.write_text(json.dumps(peer), encoding="utf-8")
            po.write_text(json.dumps(other), encoding="utf-8")
            out, md = Path(d) / "bits.svg", Path(d) / "t.md"
            self.assertEqual(lcr.main([run, "--bits-svg", str(out), "--md", str(md), "--peer", str(pp),
                                       "--peer", str(po)]), 0)
            svg, text = out.read_text(encoding="utf-8"), md.read_text(encoding="utf-8")
        root = ET.fromstring(svg)
        ns = "{http://www.w3.org/2000/svg}"
        squares = [r for r in root.findall(f"{ns}rect") if r.get("fill") == lcr.PALETTE[2]]
        self.assertEqual(len(squares), 2)
        self.assertIn("llama.cpp q8_0:norot", svg)
        # one table, rows by bits: kvq's 4.5-bit rows (with their paging), llama.cpp q4_0, then q8_0
        self.assertIn("| cache | paging / rotation | bits/el | mean KL | p99 KL | top-1 | ΔPPL |", text)
        self.assertIn("| llama.cpp `q4_0` | rotation on | 4.50 | 6.00e-02 | 5.00e-01 | 0.8800 | +0.900 |", text)
        self.assertIn("| kvq `kivi2/g32` | P 32, R 32, r 0 | 4.50 | 2.00e-02 | - | 0.9700 | +0.050 |", text)
        self.assertLess(text.index("llama.cpp `q4_0`"), text.index("llama.cpp `q8_0`"))
        self.assertEqual(text.count("llama-cpp-python 0.3.36"), 1)

    def test_not_a_record(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(SystemExit):
                lcr.load(self._write(d, {"kind": "other"}))

    @staticmethod
    def _write(d, obj):
        import json
        p = Path(d) / "run.json"
        p.write_text(json.dumps(obj), encoding="utf-8")
        return str(p)


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False).result.wasSuccessful() else 1)

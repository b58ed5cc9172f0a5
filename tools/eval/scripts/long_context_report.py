#!/usr/bin/env python3
"""Long-context results of kvq-eval runs: an SVG of KL against position and a markdown table.

usage: long_context_report.py RUN.json [RUN.json ...] [--svg OUT.svg] [--bits-svg OUT.svg] [--md OUT.md]
                               [--peer PEER.json ...]

Each RUN.json is a kvq-eval record (schema kvq.eval v1, tools/eval/include/eval/report.hpp),
one per evaluation text. Python 3 standard library only.

--svg writes one standalone SVG (no script, no external reference): per run a panel of the mean
KL(P_fp16 || P_config) against the absolute position, one line per configuration (the fine
series `kl_by_position`, a point per --kl-bucket positions), log y axis, linear x axis.

--bits-svg writes one standalone SVG of mean KL (log) against bits per element (pages and the
FP16 window), a point per configuration, rotated ones (`+rot`) in red, with sink pages (`+sink`)
in orange, both in purple; with --peer, the peer's caches as green squares in every panel of the
same text.

--peer names records of bench/peer_llamacpp_quality.py (llama.cpp's quantized caches against its
own f16 cache on the same positions): --md then adds a table of every configuration of the runs
and of the peers with the same text, ordered by bits per element, with each run's paging
(page tokens P, window R, recent r) beside kvq's rows.

--md (default: stdout) writes the markdown tables for docs/quality.md: per run the mean KL, top-1
agreement and perplexity change by position range (`position_buckets`: fixed edges 0, 512, 1K,
2K, 4K, 8K) and over all positions; then the needle pass rates by context, single-key and
multi-key apart, one row per configuration with the FP16 cache's own row first and, in brackets
beside every other cell, the pass rate over the trials the FP16 cache passed. A needle result
is multi-key when its `kind` is "multi" or it has more than one entry in `keys`; single-key
otherwise.
"""
import argparse
import json
import math
import sys
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22"]


def label(v):
    return f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v)


def range_label(first, end):
    return f"{label(first)}-{label(end)}"


def load(path):
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    if rec.get("kind") != "kvq.eval":
        raise SystemExit(f"{path}: not a kvq-eval record (kind {rec.get('kind')!r})")
    return rec


def title_of(rec):
    t = rec["text"]
    return f"{t['path'].rsplit('/', 1)[-1]}, positions {t['positions'][0]}..{t['positions'][1]}"


# ---- the SVG --------------------------------------------------------------------------------------

def series(cfg):
    k = cfg["kl_by_position"]
    b, first = k["bucket"], k["first_position"]
    pts = []
    for i, v in enumerate(k["mean_kl"]):
        if v is not None and v > 0:  # a log axis has no place for 0
            pts.append((first + i * b + b / 2, v))
    return pts


def panel(rec, y0, width, height):
    """One run's chart as SVG elements, its top at y0."""
    left, right, top, bottom = 70, 170, 28, 40
    pw, ph = width - left - right, height - top - bottom
    cfgs = [c for c in rec["configs"] if not c["reference"]]
    lines = [(c["name"], series(c)) for c in cfgs]
    ys = [v for _, pts in lines for _, v in pts]
    first, last = rec["text"]["positions"]
    x_lo, x_hi = 0, max(last + 1, 1)
    if ys:
        lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
        hi = max(hi, lo + 1)
    else:
        lo, hi = -6, 0
    X = lambda x: left + pw * (x - x_lo) / (x_hi - x_lo)
    Y = lambda v: y0 + top + ph * (hi - math.log10(v)) / (hi - lo)
    s = [f'<text x="{left}" y="{y0 + 16}" font-weight="bold">mean KL to FP16 against position: '
         f'{escape(title_of(rec))}</text>']
    s.append(f'<rect x="{left}" y="{y0 + top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for e in range(lo, hi + 1):
        y = Y(10.0 ** e)
        s.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        s.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    tick = 512
    while (x_hi - x_lo) / tick > 10:
        tick *= 2
    for t in range(0, x_hi + 1, tick):
        x = X(t)
        s.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0 + top}" y2="{y0 + top + ph}" stroke="#eee"/>')
        s.append(f'<text x="{x:.1f}" y="{y0 + top + ph + 16}" text-anchor="middle">{label(t)}</text>')
    s.append(f'<text x="{left + pw / 2}" y="{y0 + height - 6}" text-anchor="middle">position (tokens; the first '
             f'{first} are the prefill)</text>')
    s.append(f'<text transform="translate(16 {y0 + top + ph / 2}) rotate(-90)" text-anchor="middle">'
             f'mean KL, nats (log)</text>')
    for i, (name, pts) in enumerate(lines):
        color = PALETTE[i % len(PALETTE)]
        if pts:
            d = " ".join(f"{X(x):.1f},{Y(v):.1f}" for x, v in pts)
            s.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        ly = y0 + top + 14 + 18 * i
        s.append(f'<line x1="{left + pw + 10}" x2="{left + pw + 30}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" '
                 f'stroke-width="3"/>')
        s.append(f'<text x="{left + pw + 36}" y="{ly}">{escape(name)}{"" if pts else " (KL 0)"}</text>')
    return s


def render_panels(recs, panel_of, width, height):
    """One standalone SVG: a panel per run, stacked."""
    body = []
    for i, rec in enumerate(recs):
        body += panel_of(rec, i * height, width, height)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height * len(recs)}" '
            f'viewBox="0 0 {width} {height * len(recs)}" font-family="sans-serif" font-size="12">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")


def render_svg(recs):
    return render_panels(recs, panel, 900, 360)


def suffix_color(name):
    """A configuration's colour by its cache suffixes: plain blue, rotated (`+rot`) red, with
    sink pages (`+sink`) orange, both purple."""
    parts = name.split("+")[1:]
    rot, sink = "rot" in parts, any(p.startswith("sink") for p in parts)
    return PALETTE[4] if rot and sink else PALETTE[3] if sink else PALETTE[1] if rot else PALETTE[0]


def bits_panel(rec, y0, width, height, peer_pts=()):
    """One run's scatter of bits per element against mean KL as SVG elements, its top at y0: a
    point per configuration (coloured by `suffix_color`), labelled with its name, and the
    peer's (bits, KL, label) points as green squares."""
    left, right, top, bottom = 70, 30, 28, 40
    pw, ph = width - left - right, height - top - bottom
    pts = [(c["bits"]["total_bits"], c["quality"]["mean_kl"], c["name"]) for c in rec["configs"]
           if not c["reference"] and c["quality"]["mean_kl"] is not None and c["quality"]["mean_kl"] > 0]
    xs, ys = [x for x, _, _ in pts + list(peer_pts)], [v for _, v, _ in pts + list(peer_pts)]
    x_lo, x_hi = (math.floor(min(xs)) - 0.5, math.ceil(max(xs)) + 0.5) if xs else (0, 16)
    lo, hi = (math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))) if ys else (-6, 0)
    hi = max(hi, lo + 1)
    X = lambda x: left + pw * (x - x_lo) / (x_hi - x_lo)
    Y = lambda v: y0 + top + ph * (hi - math.log10(v)) / (hi - lo)
    s = [f'<text x="{left}" y="{y0 + 16}" font-weight="bold">mean KL to FP16 against bits per element '
         f'(pages and FP16 window): {escape(title_of(rec))}</text>',
         f'<rect x="{left}" y="{y0 + top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for e in range(lo, hi + 1):
        y = Y(10.0 ** e)
        s.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        s.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    for b in range(math.ceil(x_lo), math.floor(x_hi) + 1):
        x = X(b)
        s.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0 + top}" y2="{y0 + top + ph}" stroke="#eee"/>')
        s.append(f'<text x="{x:.1f}" y="{y0 + top + ph + 16}" text-anchor="middle">{b}</text>')
    s.append(f'<text x="{left + pw / 2}" y="{y0 + height - 6}" text-anchor="middle">bits per element</text>')
    s.append(f'<text transform="translate(16 {y0 + top + ph / 2}) rotate(-90)" text-anchor="middle">'
             f'mean KL, nats (log)</text>')
    for x, v, name in pts:
        color = suffix_color(name)
        s.append(f'<circle cx="{X(x):.1f}" cy="{Y(v):.1f}" r="4" fill="{color}"/>')
        s.append(f'<text x="{X(x) + 7:.1f}" y="{Y(v) + 4:.1f}" fill="{color}">{escape(name)}</text>')
    for x, v, name in peer_pts:
        s.append(f'<rect x="{X(x) - 4:.1f}" y="{Y(v) - 4:.1f}" width="8" height="8" fill="{PALETTE[2]}"/>')
        s.append(f'<text x="{X(x) + 7:.1f}" y="{Y(v) + 4:.1f}" fill="{PALETTE[2]}">{escape(name)}</text>')
    return s


def render_bits_svg(recs, peers=()):
    def panel_of(rec, y0, width, height):
        return bits_panel(rec, y0, width, height, peers_of(rec, peers))
    return render_panels(recs, panel_of, 900, 420)


# ---- the peer (llama.cpp) ------------------------------------------------------------------------

def load_peer(path):
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    if rec.get("peer") != "llama.cpp" or "configs" not in rec:
        raise SystemExit(f"{path}: not a bench/peer_llamacpp_quality.py record")
    return rec


def same_text(a, b):
    return a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1]


def peers_of(rec, peers):
    """The peer caches measured on the run's text: (bits, mean KL, label) each."""
    return [(c["bits_per_element"], c["mean_kl"], f"llama.cpp {c['cache']}") for p in peers
            if same_text(p["text"], rec["text"]["path"]) for c in p["configs"] if c["mean_kl"] > 0]


def sci(v):
    return "-" if v is None else f"{v:.2e}"


def paging(rec):
    c = rec.get("cache")
    if not c:
        return "-"
    return f"P {c['page_tokens']}, R {c['window']}, r {c['recent']}"


def peer_table(recs, peers):
    """Every configuration of the runs and of the peers on one text, ordered by bits per element."""
    out = []
    for text in dict.fromkeys(r["text"]["path"] for r in recs):
        runs = [r for r in recs if r["text"]["path"] == text]
        ps = [p for p in peers if same_text(p["text"], text)]
        if not ps:
            continue
        first, end = runs[0]["text"]["positions"]
        rows = []
        for r in runs:
            for c in r["configs"]:
                if c["reference"]:
                    continue
                q = c["quality"]
                rows.append((c["bits"]["total_bits"], [f"kvq `{c['name']}`", paging(r), f"{c['bits']['total_bits']:.2f}",
                             f"{q['mean_kl']:.2e}", sci(q.get("p99_kl")), f"{q['top1_agreement']:.4f}",
                             f"{q['perplexity_delta']:+.3f}"]))
        for p in ps:
            for c in p["configs"]:
                rot = "rotation on" if c["rotation"] else "rotation off"
                rows.append((c["bits_per_element"], [f"llama.cpp `{c['type']}`", rot, f"{c['bits_per_element']:.2f}",
                             f"{c['mean_kl']:.2e}", f"{c['p99_kl']:.2e}", f"{c['top1_agreement']:.4f}",
                             f"{c['delta_ppl']:+.3f}"]))
        rows.sort(key=lambda r: (r[0], r[1][0]))
        versions = ", ".join(sorted({f"llama-cpp-python {p['version']}" for p in ps}))
        out.append(f"**{escape(text.rsplit('/', 1)[-1])}, positions {first}..{end}**: kvq against its FP16 cache, "
                   f"llama.cpp ({versions}) against its f16 cache\n\n" +
                   table(["cache", "paging / rotation", "bits/el", "mean KL", "p99 KL", "top-1", "ΔPPL"],
                         [r[1] for r in rows]))
    return "\n".join(out)


# ---- the markdown -----------------------------------------------------------------------------------

def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def quality_table(rec):
    ref = next(c for c in rec["configs"] if c["reference"])
    ranges = [(b["first"], b["end"]) for b in ref["position_buckets"]]
    head = ["configuration", "bits/el"] + [f"KL {range_label(*r)}" for r in ranges] + \
           ["KL all", "top-1 all"] + [f"top-1 {range_label(*r)}" for r in ranges[-1:]] + \
           ["ΔPPL all"] + [f"ΔPPL {range_label(*r)}" for r in ranges[-1:]]
    rows = []
    for c in rec["configs"]:
        if c["reference"]:
            continue
        by = {(b["first"], b["end"]): b for b in c["position_buckets"]}
        q = c["quality"]
        row = [f"`{c['name']}`", f"{c['bits']['total_bits']:.2f}"]
        row += [f"{by[r]['mean_kl']:.2e}" if r in by else "-" for r in ranges]
        row += [f"{q['mean_kl']:.2e}", f"{q['top1_agreement']:.4f}"]
        row += [f"{by[r]['top1_agreement']:.4f}" if r in by else "-" for r in ranges[-1:]]
        row += [f"{q['perplexity_delta']:+.3f}"]
        row += [f"{by[r]['perplexity_delta']:+.3f}" if r in by else "-" for r in ranges[-1:]]
        rows.append(row)
    ppl = ", ".join(f"{range_label(b['first'], b['end'])} {b['perplexity']:.2f}" for b in ref["position_buckets"])
    return (f"**{escape(title_of(rec))}** (FP16-cache perplexity {ref['quality']['perplexity']:.3f}; by range: "
            f"{ppl})\n\n" + table(head, rows))


def needle_kind(result):
    if result.get("kind") == "multi" or len(result.get("keys", [])) > 1:
        return "multi-key"
    return "single-key"


def trial_id(index, result):
    """What identifies a trial across configurations: its context, depth, repetition and key(s)."""
    keys = result.get("keys") or result.get("key")
    return (result["context"], result.get("depth"), result.get("rep"), json.dumps(keys), index)


def needle_table(rec):
    """Pass rates by (kind, context), FP16's row first and, beside every other cell, the rate over
    the trials the FP16 cache passed; None when the run had no finished needle trial."""
    ref = next(c for c in rec["configs"] if c["reference"])
    ref_pass = {trial_id(i, r): r["pass"] for i, r in enumerate(ref["needle"]["results"]) if r.get("done", True)}
    cells = {}  # config -> (kind, context) -> [passed, trials, passed where FP16 passed, FP16 passed]
    cols = set()
    for c in rec["configs"]:
        for i, r in enumerate(c["needle"]["results"]):
            if not r.get("done", True):
                continue
            k = (needle_kind(r), r["context"])
            cols.add(k)
            p = cells.setdefault(c["name"], {}).setdefault(k, [0, 0, 0, 0])
            p[0] += 1 if r["pass"] else 0
            p[1] += 1
            if ref_pass.get(trial_id(i, r)):
                p[2] += 1 if r["pass"] else 0
                p[3] += 1
    if not cols:
        return None
    cols = sorted(cols, key=lambda k: (k[0] != "single-key", k[1]))
    order = sorted(rec["configs"], key=lambda c: not c["reference"])
    head = ["configuration"] + [f"{kind} {label(ctx)}" for kind, ctx in cols]
    rows = []
    for c in order:
        got = cells.get(c["name"], {})
        name = f"`{c['name']}`" + (" (reference)" if c["reference"] else "")

        def cell(k):
            if k not in got:
                return "-"
            p = got[k]
            return f"{p[0]}/{p[1]}" if c["reference"] else f"{p[0]}/{p[1]} ({p[2]}/{p[3]})"

        rows.append([name] + [cell(k) for k in cols])
    hay = rec["needle"]["haystack_path"].rsplit("/", 1)[-1]
    return (f"Needle pass rates (passed/trials) on `{hay}`, FP16's own first; in brackets the rate over the "
            f"trials the FP16 cache passed (a trial FP16 fails says nothing about the cache under test).\n\n" +
            table(head, rows))


def render_md(recs, peers=()):
    parts = ["Mean KL(P_fp16 ‖ P_config) in nats, top-1 agreement with the FP16 cache and the perplexity change "
             "against it, by range of absolute positions.\n"]
    for rec in recs:
        parts.append(quality_table(rec))
    for rec in recs:
        n = needle_table(rec)
        if n:
            parts.append(n)
    if peers:
        parts.append(peer_table(recs, peers))
    cmd = "; ".join(f"`{r['command']}`" for r in recs if r.get("command"))
    parts.append(f"Commands: {cmd}\n" if cmd else "")
    return "\n".join(p for p in parts if p)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="kvq-eval JSON records")
    ap.add_argument("--svg", help="write the KL-against-position SVG here")
    ap.add_argument("--bits-svg", help="write the SVG of mean KL against bits per element here")
    ap.add_argument("--md", help="write the markdown tables here (default: stdout)")
    ap.add_argument("--peer", action="append", default=[],
                    help="a bench/peer_llamacpp_quality.py record (repeatable)")
    a = ap.parse_args(argv)
    recs = [load(p) for p in a.runs]
    peers = [load_peer(p) for p in a.peer]
    if a.svg:
        with open(a.svg, "w", encoding="utf-8") as f:
            f.write(render_svg(recs))
    if a.bits_svg:
        with open(a.bits_svg, "w", encoding="utf-8") as f:
            f.write(render_bits_svg(recs, peers))
    md = render_md(recs, peers)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

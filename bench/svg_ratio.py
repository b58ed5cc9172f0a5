"""The x axis and file ending of the benchmark reports' ratio charts (plain SVG, no dependencies):
report_decode.py and report_shapes.py draw kvq / peer ratios against it."""


def axis_and_save(path, out, x, y, ticks, strong, label, center):
    """Appends vertical grid lines at `ticks` from y = 46 to `y` (those in `strong` red and bold,
    or bold grey when `strong` holds only 1.0 of a chart without targets), their labels, the axis
    label centred at `center`, closes the SVG and writes `out` to `path`."""
    for t in ticks:
        color = "#D62728" if t in strong and len(strong) > 1 else "#999"
        out.append(f'<line x1="{x(t):.1f}" y1="46" x2="{x(t):.1f}" y2="{y}" stroke="{color}" '
                   f'stroke-width="{1 if t in strong else 0.3}"/>'
                   f'<text x="{x(t):.1f}" y="{y + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{center}" y="{y + 30}" text-anchor="middle">{label}</text></svg>')
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")

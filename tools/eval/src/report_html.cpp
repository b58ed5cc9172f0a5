// The self-contained HTML report: inline CSS and SVG only (no script, no external reference), so
// the file can be mailed, attached to an issue or opened offline.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <eval/report.hpp>
#include <map>

namespace kvq::eval {

namespace {

constexpr const char* palette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                   "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};

std::string esc(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

const char* color_of(size_t i) { return palette[i % std::size(palette)]; }

/// Colour of a format in the maps: hue by bits (what matters most for memory), lighter for the
/// symmetric and fp8 families than for kivi / rolealign of the same bits.
std::string format_color(kvq::format_id id) {
  const auto t = kvq::traits_of(id);
  switch (t.bits) {
    case 16:
      return t.fam == kvq::family::bf16 ? "#6b8fb5" : "#3b6ea5";
    case 8:
      return t.fam == kvq::family::fp8_e4m3 ? "#8cc084" : t.fam == kvq::family::sym ? "#59a14f" : "#3d7a35";
    case 4:
      return t.fam == kvq::family::sym ? "#f5b461" : t.fam == kvq::family::rolealign ? "#c96f0e" : "#f28e2b";
    case 2:
      return t.fam == kvq::family::sym ? "#ef8a8c" : t.fam == kvq::family::rolealign ? "#a62b2e" : "#e15759";
    default:
      return "#999999";
  }
}

/// Colour of a mean bit width (for the map over time): 2 red ... 16 blue.
std::string bits_color(double bits) {
  const double t = std::clamp((std::log2(std::max(bits, 1.0)) - 1.0) / 3.0, 0.0, 1.0);  // 2 -> 0, 16 -> 1
  const int r = int(225 + (59 - 225) * t), g = int(87 + (110 - 87) * t), b = int(89 + (165 - 89) * t);
  return fmt::format("#{:02x}{:02x}{:02x}", r, g, b);
}

std::string fmt_sci(double v) {
  if (v == 0) return "0";
  return fmt::format("{:.2e}", v);
}

/// Decade bounds [lo, hi] covering the positive values (or 1e-6..1e-2 when there are none).
std::pair<double, double> log_range(const std::vector<double>& values) {
  double mn = INFINITY, mx = 0;
  for (double v : values)
    if (v > 0 && std::isfinite(v)) mn = std::min(mn, v), mx = std::max(mx, v);
  if (!(mx > 0)) return {1e-6, 1e-2};
  double lo = std::pow(10.0, std::floor(std::log10(mn)));
  double hi = std::pow(10.0, std::ceil(std::log10(mx)));
  if (hi <= lo) hi = lo * 10;
  return {lo, hi};
}

struct frame {
  double w = 640, h = 340, left = 70, right = 20, top = 20, bottom = 50;
  double x0() const { return left; }
  double x1() const { return w - right; }
  double y0() const { return h - bottom; }  // bottom edge of the plot area
  double y1() const { return top; }
};

std::string svg_open(const frame& f, std::string_view label) {
  return fmt::format(
      "<svg width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" role=\"img\" "
      "aria-label=\"{2}\" font-family=\"sans-serif\" font-size=\"11\">\n",
      f.w, f.h, esc(label));
}

/// Scatter of bits per element (x) against mean KL (y, log); KL 0 sits on the bottom edge.
std::string scatter_bits_kl(const eval_report& r) {
  frame f;
  f.w = 680;
  f.h = 380;
  f.right = 170;
  std::vector<double> kls;
  double max_bits = 0;
  for (const auto& c : r.configs) {
    kls.push_back(c.quality.mean_kl());
    max_bits = std::max(max_bits, c.stats.total_bits(r.shape.kv_heads, r.shape.head_dim));
  }
  auto [lo, hi] = log_range(kls);
  lo /= 10;  // one decade of room below the smallest KL for the KL = 0 row
  const double xmax = std::max(4.0, std::ceil((max_bits + 0.5) / 2) * 2);
  auto X = [&](double b) { return f.x0() + (f.x1() - f.x0()) * b / xmax; };
  auto Y = [&](double kl) {
    if (kl <= 0) return f.y0();
    const double t = (std::log10(kl) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
    return f.y0() - (f.y0() - f.y1()) * std::clamp(t, 0.0, 1.0);
  };
  std::string s = svg_open(f, "bits per element against mean KL");
  for (double d = lo; d <= hi * 1.0001; d *= 10) {
    const double y = Y(d);
    s +=
        fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e5e5e5\"/>", f.x0(), y, f.x1(), y);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", f.x0() - 6, y + 4,
                     d == lo ? "0 / " + fmt::format("{:.0e}", d) : fmt::format("{:.0e}", d));
  }
  for (double b = 0; b <= xmax + 1e-9; b += 2) {
    const double x = X(b);
    s +=
        fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#e5e5e5\"/>", x, f.y1(), x, f.y0());
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:g}</text>\n", x, f.y0() + 16, b);
  }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>", f.x0(), f.y1(),
                   f.x1() - f.x0(), f.y0() - f.y1());
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">bits per element (pages + FP16 window)</text>",
                   (f.x0() + f.x1()) / 2, f.h - 12);
  s += fmt::format(
      "<text transform=\"translate(14 {}) rotate(-90)\" text-anchor=\"middle\">mean KL(P_fp16 || P_config), "
      "nats</text>\n",
      (f.y0() + f.y1()) / 2);
  for (size_t i = 0; i < r.configs.size(); ++i) {
    const auto& c = r.configs[i];
    const double x = X(c.stats.total_bits(r.shape.kv_heads, r.shape.head_dim)), y = Y(c.quality.mean_kl());
    s += fmt::format(
        "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"6\" fill=\"{}\" stroke=\"#333\"><title>{}: {:.3f} bits, KL "
        "{}</title></circle>",
        x, y, color_of(i), esc(c.config), c.stats.total_bits(r.shape.kv_heads, r.shape.head_dim),
        fmt_sci(c.quality.mean_kl()));
    // legend
    const double ly = f.y1() + 8 + 18 * double(i);
    s += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"5\" fill=\"{}\" stroke=\"#333\"/>", f.x1() + 16, ly, color_of(i));
    s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", f.x1() + 26, ly + 4, esc(c.config));
  }
  return s + "</svg>\n";
}

/// Mean KL per bucket of positions, one line per configuration (log y; zero buckets clipped).
std::string kl_over_position(const eval_report& r) {
  frame f;
  f.w = 680;
  f.right = 170;
  const int64_t bucket = r.options.kl_bucket;
  std::vector<std::vector<double>> series;
  std::vector<double> all;
  for (const auto& c : r.configs) {
    series.push_back(c.quality.kl_by_bucket(bucket));
    all.insert(all.end(), series.back().begin(), series.back().end());
  }
  auto [lo, hi] = log_range(all);
  const double p0 = double(r.options.prefill), p1 = double(r.options.prefill + r.options.tokens);
  auto X = [&](double p) { return f.x0() + (f.x1() - f.x0()) * (p - p0) / std::max(p1 - p0, 1.0); };
  auto Y = [&](double kl) {
    const double t = kl > 0 ? (std::log10(kl) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) : 0.0;
    return f.y0() - (f.y0() - f.y1()) * std::clamp(t, 0.0, 1.0);
  };
  std::string s = svg_open(f, "mean KL over position");
  for (double d = lo; d <= hi * 1.0001; d *= 10) {
    const double y = Y(d);
    s +=
        fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e5e5e5\"/>", f.x0(), y, f.x1(), y);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.0e}</text>\n", f.x0() - 6, y + 4, d);
  }
  const double step = std::max(1.0, std::pow(10.0, std::floor(std::log10(std::max(p1 - p0, 1.0)))) / 2);
  for (double p = std::ceil(p0 / step) * step; p <= p1; p += step) {
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:g}</text>", X(p), f.y0() + 16, p);
  }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>", f.x0(), f.y1(),
                   f.x1() - f.x0(), f.y0() - f.y1());
  s += fmt::format(
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">position (mean over buckets of {} decode steps)</text>",
      (f.x0() + f.x1()) / 2, f.h - 12, bucket);
  s += fmt::format("<text transform=\"translate(14 {}) rotate(-90)\" text-anchor=\"middle\">mean KL, nats</text>\n",
                   (f.y0() + f.y1()) / 2);
  for (size_t i = 0; i < series.size(); ++i) {
    if (r.configs[i].reference) continue;
    std::string pts;
    for (size_t b = 0; b < series[i].size(); ++b) {
      const double mid = p0 + (double(b) + 0.5) * double(bucket);
      pts += fmt::format("{:.1f},{:.1f} ", X(std::min(mid, p1)), Y(series[i][b]));
    }
    s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", pts, color_of(i));
    const double ly = f.y1() + 8 + 18 * double(i);
    s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"3\"/>", f.x1() + 10,
                     ly, f.x1() + 24, ly, color_of(i));
    s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", f.x1() + 30, ly + 4, esc(r.configs[i].config));
  }
  return s + "</svg>\n";
}

/// Horizontal bars, one per configuration; `value` may be negative (bars grow from zero).
std::string bar_chart(const eval_report& r, std::string_view title, const std::vector<double>& value,
                      const std::vector<std::string>& label) {
  frame f;
  f.left = 150;
  f.right = 110;
  f.top = 30;
  f.bottom = 20;
  f.h = f.top + f.bottom + 24 * double(r.configs.size());
  f.w = 520;
  double lo = 0, hi = 0;
  for (double v : value) lo = std::min(lo, v), hi = std::max(hi, v);
  if (hi - lo <= 0) hi = lo + 1;
  auto X = [&](double v) { return f.x0() + (f.x1() - f.x0()) * (v - lo) / (hi - lo); };
  std::string s = svg_open(f, title);
  s += fmt::format("<text x=\"{}\" y=\"16\" font-weight=\"bold\">{}</text>\n", f.x0(), esc(title));
  s += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#888\"/>", X(0), f.y1(), X(0),
                   f.y0());
  for (size_t i = 0; i < r.configs.size(); ++i) {
    const double y = f.top + 24 * double(i);
    const double a = X(std::min(0.0, value[i])), b = X(std::max(0.0, value[i]));
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>", f.x0() - 8, y + 15,
                     esc(r.configs[i].config));
    s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"18\" fill=\"{}\"/>", a, y + 2,
                     std::max(b - a, 1.0), color_of(i));
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", std::max(b, X(0)) + 6, y + 15, esc(label[i]));
  }
  return s + "</svg>\n";
}

/// Configurations (rows) by (context, depth) (columns): passed / trials.
std::string needle_matrix(const eval_report& r) {
  std::vector<std::pair<int64_t, double>> cols;
  for (const auto& t : r.trials)
    if (std::find(cols.begin(), cols.end(), std::pair{t.context, t.depth}) == cols.end())
      cols.emplace_back(t.context, t.depth);
  frame f;
  f.left = 150;
  f.top = 44;
  const double cw = 72, ch = 24;
  f.w = f.left + cw * double(cols.size()) + 20;
  f.h = f.top + ch * double(r.configs.size()) + 10;
  std::string s = svg_open(f, "needle pass matrix");
  for (size_t j = 0; j < cols.size(); ++j) {
    const double x = f.left + cw * double(j) + cw / 2;
    s += fmt::format("<text x=\"{:.1f}\" y=\"16\" text-anchor=\"middle\">ctx {}</text>", x, cols[j].first);
    s += fmt::format("<text x=\"{:.1f}\" y=\"32\" text-anchor=\"middle\">depth {:g}</text>\n", x, cols[j].second);
  }
  for (size_t i = 0; i < r.configs.size(); ++i) {
    const auto& c = r.configs[i];
    const double y = f.top + ch * double(i);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>", f.left - 8, y + 16, esc(c.config));
    for (size_t j = 0; j < cols.size(); ++j) {
      int pass = 0, n = 0;
      std::string outputs;
      for (const auto& nr : c.needle)
        if (nr.trial.context == cols[j].first && nr.trial.depth == cols[j].second) {
          ++n;
          pass += nr.pass ? 1 : 0;
          outputs += fmt::format("{}key {} -> \"{}\"", outputs.empty() ? "" : "; ", nr.trial.key, nr.output);
        }
      const char* fill = n == 0 ? "#eeeeee" : pass == n ? "#59a14f" : pass == 0 ? "#e15759" : "#edc948";
      const double x = f.left + cw * double(j);
      s += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{}\" height=\"{}\" fill=\"{}\" "
          "stroke=\"#fff\"><title>{}</title></rect>",
          x, y, cw - 2, ch - 2, fill, esc(outputs));
      s += fmt::format(
          "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#fff\" font-weight=\"bold\">{}/{}</text>\n",
          x + cw / 2 - 1, y + 16, pass, n);
    }
  }
  return s + "</svg>\n";
}

/// The per-(layer, kv head) map of one configuration: K heads then V heads, one row per layer.
std::string format_map_svg(const eval_report& r, const config_result& c) {
  const auto& map = c.format_map_history.empty() ? c.stats.format_map : c.format_map_history.back().map;
  const int L = r.shape.layers, H = r.shape.kv_heads;
  const double cell = 12, gap = 8, left = 28, top = 30;
  frame f;
  f.w = left + cell * 2 * H + gap + 10;
  f.h = top + cell * L + 10;
  std::string s = svg_open(f, "format map of " + c.config);
  s += fmt::format("<text x=\"{}\" y=\"22\" text-anchor=\"middle\">K</text>", left + cell * H / 2);
  s += fmt::format("<text x=\"{}\" y=\"22\" text-anchor=\"middle\">V</text>\n", left + cell * H + gap + cell * H / 2);
  for (int l = 0; l < L; ++l) {
    const double y = top + cell * l;
    if (l % 5 == 0)
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" font-size=\"9\">{}</text>", left - 4, y + 9, l);
    for (int h = 0; h < H; ++h) {
      const size_t i = size_t(l) * size_t(H) + size_t(h);
      const kvq::format_pair p = i < map.size() ? map[i] : kvq::format_pair{};
      for (int role = 0; role < 2; ++role) {
        const kvq::format_id id = role == 0 ? p.k : p.v;
        const double x = left + (role == 0 ? 0 : cell * H + gap) + cell * h;
        s += fmt::format(
            "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"#fff\" "
            "stroke-width=\"0.5\">"
            "<title>layer {} head {} {}: {}</title></rect>",
            x, y, cell, cell, format_color(id), l, h, role == 0 ? "K" : "V", kvq::format_name(id));
      }
    }
  }
  return s + "</svg>\n";
}

/// Mean bits per layer over decode steps, when a policy changed its map during the run.
std::string map_over_time_svg(const eval_report& r, const config_result& c) {
  const auto& hist = c.format_map_history;
  const int L = r.shape.layers, H = r.shape.kv_heads;
  frame f;
  f.left = 40;
  f.top = 10;
  f.bottom = 36;
  f.w = 640;
  const double row = 10;
  f.h = f.top + f.bottom + row * L;
  const double t0 = 0, t1 = double(std::max<int64_t>(r.options.tokens, 1));
  auto X = [&](double t) { return f.x0() + (f.x1() - f.x0()) * (t - t0) / (t1 - t0); };
  std::string s = svg_open(f, "format map over decode steps of " + c.config);
  for (size_t k = 0; k < hist.size(); ++k) {
    const double a = X(double(hist[k].step)), b = X(k + 1 < hist.size() ? double(hist[k + 1].step) : t1);
    for (int l = 0; l < L; ++l) {
      double bits = 0;
      for (int h = 0; h < H; ++h) {
        const size_t i = size_t(l) * size_t(H) + size_t(h);
        const kvq::format_pair p = i < hist[k].map.size() ? hist[k].map[i] : kvq::format_pair{};
        bits += kvq::traits_of(p.k).bits + kvq::traits_of(p.v).bits;
      }
      bits /= 2.0 * H;
      s += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\"><title>layer {} from step {}: "
          "{:.2f} bits</title></rect>",
          a, f.top + row * l, std::max(b - a, 0.5), row, bits_color(bits), l, hist[k].step, bits);
    }
  }
  for (int l = 0; l < L; l += 5)
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" font-size=\"9\">{}</text>", f.x0() - 4,
                     f.top + row * l + 8, l);
  s += fmt::format(
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">decode step (colour: mean code bits of the layer, red 2 ... "
      "blue 16)</text>\n",
      (f.x0() + f.x1()) / 2, f.h - 10);
  return s + "</svg>\n";
}

std::string legend_of_formats(const eval_report& r) {
  std::map<int, std::string> used;
  for (const auto& c : r.configs) {
    const auto& map = c.format_map_history.empty() ? c.stats.format_map : c.format_map_history.back().map;
    for (const auto& p : map) {
      used[p.k] = kvq::format_name(p.k);
      used[p.v] = kvq::format_name(p.v);
    }
  }
  std::string s = "<div class=\"legend\">";
  for (const auto& [id, name] : used)
    s += fmt::format("<span><i style=\"background:{}\"></i>{}</span>", format_color(kvq::format_id(id)), esc(name));
  return s + "</div>\n";
}

}  // namespace

/// KL, top-1 and ΔPPL per long-context position bucket, rows per configuration and measure.
std::string position_bucket_table(const eval_report& r) {
  if (r.configs.empty()) return {};
  const auto ref = long_context_buckets(r, r.configs[r.reference]);
  std::string h = "<table>\n<tr><th>configuration</th><th>measure</th>";
  for (const auto& b : ref) h += fmt::format("<th>{}</th>", position_range_label(b.bucket.first, b.bucket.end));
  h += "</tr>\n";
  auto row = [&](const std::string& name, const char* measure, const std::vector<bucket_row>& rows, auto cell) {
    h += fmt::format("<tr><td>{}</td><td>{}</td>", esc(name), measure);
    for (size_t b = 0; b < ref.size(); ++b)
      h += "<td>" + (b < rows.size() ? cell(rows[b]) : std::string("-")) + "</td>";
    h += "</tr>\n";
  };
  for (const auto& c : r.configs) {
    if (c.reference) continue;
    const auto rows = long_context_buckets(r, c);
    row(c.config, "mean KL", rows, [](const bucket_row& b) { return fmt_sci(b.bucket.mean_kl); });
    row("", "top-1", rows, [](const bucket_row& b) { return fmt::format("{:.4f}", b.bucket.top1_agreement); });
    row("", "&Delta;PPL", rows, [](const bucket_row& b) { return fmt::format("{:+.3f}", b.perplexity_delta); });
  }
  row(r.configs[r.reference].config + " (reference)", "PPL", ref,
      [](const bucket_row& b) { return fmt::format("{:.3f}", b.bucket.perplexity()); });
  return h +
         "</table>\n<p class=\"note\">Means over each range of absolute positions (fixed edges 0, 512, 1K, 2K, "
         "4K, 8K); &Delta;PPL against the reference's perplexity over the same positions.</p>\n";
}

std::string render_html(const eval_report& r) {
  const auto& o = r.options;
  const auto& hp = r.model.hparams;
  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  h += fmt::format("<title>kvq-eval: {}</title>\n", esc(r.model.name));
  h += R"(<style>
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px} th,td{padding:4px 8px;border-bottom:1px solid #eee;text-align:right}
th{background:#f6f6f6} td:first-child,th:first-child,td:nth-child(2),th:nth-child(2){text-align:left} tr.ref td{font-style:italic}
.meta{font-size:13px;color:#555} .meta code{font-size:12px;word-break:break-all}
.maps{display:flex;flex-wrap:wrap;gap:18px} .maps figure{margin:0} figcaption{font-size:12px;text-align:center}
.legend{font-size:12px;margin:8px 0} .legend span{margin-right:14px;white-space:nowrap}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
.charts{display:flex;flex-wrap:wrap;gap:18px}
.note{font-size:12px;color:#666;max-width:900px}
</style>
</head>
<body>
)";
  h += fmt::format("<h1>kvq-eval: {}</h1>\n", esc(r.model.name));
  h += "<div class=\"meta\">";
  h += fmt::format(
      "<p>{} &middot; {} layers, {} query heads, {} KV heads, head_dim {} &middot; created {} &middot; {} "
      "thread(s), {:.0f} s</p>",
      esc(r.model.path), hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, esc(r.created_utc), r.threads,
      r.wall_seconds);
  h += fmt::format(
      "<p>Text <code>{}</code> ({}): prefill of {} tokens, then {} teacher-forced decode steps (positions "
      "{}..{}), each measured against the FP16 cache <b>{}</b>. Cache: page {} tokens, FP16 window {}, "
      "recent {}.</p>",
      esc(r.text.path), esc(r.text.hash), o.prefill, o.tokens, o.prefill, o.prefill + o.tokens - 1,
      esc(r.configs.empty() ? std::string() : r.configs[r.reference].config), r.shape.page_tokens, r.shape.window,
      r.shape.recent);
  if (!o.clip_percentiles_path.empty())
    h += fmt::format("<p>rolealign clip percentiles from <code>{}</code>.</p>", esc(o.clip_percentiles_path));
  if (!o.codebook_levels_path.empty())
    h += fmt::format("<p>codebook levels fitted in <code>{}</code>.</p>", esc(o.codebook_levels_path));
  if (!o.command_line.empty()) h += fmt::format("<p>Command: <code>{}</code></p>", esc(o.command_line));
  if (r.resumed)
    h += fmt::format("<p>Teacher-forced results read back from <code>{}</code> (--resume).</p>", esc(o.resume_path));
  if (!r.complete)
    h += "<p><b>Checkpoint: the needle trials of this run had not finished when this was written.</b></p>";
  h += "</div>\n";

  // summary table
  h += "<h2>Summary</h2>\n<table>\n<tr><th>configuration</th><th>policy</th><th>bits/el</th><th>page bits</th>"
       "<th>KV MiB</th><th>vs FP16</th><th>mean KL</th><th>p99 KL</th><th>top-1</th><th>PPL</th><th>&Delta;PPL</th>"
       "<th>needle</th><th>forced tok/s</th></tr>\n";
  const double ref_ppl = r.configs.empty() ? 0.0 : r.configs[r.reference].quality.perplexity();
  for (const auto& c : r.configs) {
    const auto& q = c.quality;
    const double fp16 = double(fp16_bytes(r.shape, c.tokens_held));
    h += fmt::format(
        "<tr{}><td>{}</td><td>{}</td><td>{:.2f}</td><td>{:.2f}</td><td>{:.2f}</td><td>{:.2f}&times;</td><td>{}</td>"
        "<td>{}</td><td>{:.4f}</td><td>{:.3f}</td><td>{:+.3f}</td><td>{}</td><td>{:.1f}</td></tr>\n",
        c.reference ? " class=\"ref\"" : "", esc(c.config) + (c.reference ? " (reference)" : ""), esc(c.policy_name),
        c.stats.total_bits(r.shape.kv_heads, r.shape.head_dim), c.stats.page_bits(),
        double(c.kv_bytes()) / (1024.0 * 1024.0), c.kv_bytes() ? fp16 / double(c.kv_bytes()) : 0.0,
        fmt_sci(q.mean_kl()), fmt_sci(q.kl_quantile(0.99)), q.top1_agreement(), q.perplexity(),
        q.perplexity() - ref_ppl,
        c.needle.empty() ? std::string("-") : fmt::format("{}/{}", c.needle_passed(), c.needle.size()),
        c.decode_tokens_per_s());
  }
  h +=
      "</table>\n<p class=\"note\">bits/el: bytes of pages and FP16 windows over all K and V elements held (scales and "
      "zeros included); page bits: pages only. KL: mean over decode positions of KL(P_fp16 || P_config) in nats. "
      "Forced tok/s: teacher-forced positions over the wall time of the products' share and the configuration's own "
      "cache calls (positions run in chunks; compare within this run only).</p>\n";

  h += "<h2>Bits per element against KL</h2>\n<div class=\"charts\">" + scatter_bits_kl(r) + "</div>\n";
  h += "<h2>KL over position</h2>\n<div class=\"charts\">" + kl_over_position(r) + "</div>\n";
  h += "<h3>By position range</h3>\n" + position_bucket_table(r);

  std::vector<double> dppl, disagree;
  std::vector<std::string> dppl_label, disagree_label;
  for (const auto& c : r.configs) {
    dppl.push_back(c.quality.perplexity() - ref_ppl);
    dppl_label.push_back(fmt::format("{:+.3f} ({:.3f})", dppl.back(), c.quality.perplexity()));
    disagree.push_back(100.0 * (1.0 - c.quality.top1_agreement()));
    disagree_label.push_back(fmt::format("{:.2f} % ({:.4f})", disagree.back(), c.quality.top1_agreement()));
  }
  h += "<h2>Perplexity and top-1 agreement</h2>\n<div class=\"charts\">";
  h += bar_chart(r, "perplexity change vs FP16 (absolute in brackets)", dppl, dppl_label);
  h += bar_chart(r, "top-1 disagreement with FP16, % (agreement in brackets)", disagree, disagree_label);
  h += "</div>\n";

  h += "<h2>Needle retrieval</h2>\n";
  if (r.trials.empty()) {
    h += "<p class=\"note\">No needle trials in this run.</p>\n";
  } else {
    h += fmt::format(
        "<p class=\"note\">\"{}\" inserted at a depth of the haystack <code>{}</code>; prompt template {}; "
        "greedy decoding after \"The pass key is\"; a trial passes when the first digits written are the "
        "key. {} repetition(s) per cell; hover a cell for the answers.</p>\n",
        esc(needle_sentence("NNNNN")), esc(o.haystack_path.empty() ? o.text_path : o.haystack_path),
        template_name(r.model.tmpl), o.needle_reps);
    h += needle_matrix(r);
  }

  h += "<h2>Format maps</h2>\n<p class=\"note\">Per (layer, KV head) format at the end of the run; rows are layers, K "
       "heads left, V heads right.</p>\n";
  h += legend_of_formats(r);
  h += "<div class=\"maps\">";
  for (const auto& c : r.configs)
    h += fmt::format("<figure>{}<figcaption>{}</figcaption></figure>", format_map_svg(r, c), esc(c.config));
  h += "</div>\n";
  bool any_history = false;
  for (const auto& c : r.configs)
    if (c.format_map_history.size() > 1) {
      if (!any_history) h += "<h2>Format maps over decode steps</h2>\n";
      any_history = true;
      h += fmt::format("<h3>{}</h3>\n{}", esc(c.config), map_over_time_svg(r, c));
    }
  h += "</body>\n</html>\n";
  return h;
}

}  // namespace kvq::eval

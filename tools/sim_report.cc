// The output forms of `kvbridge sim`: the table, kvbridge.sim/1 JSON and the
// SVG plot (written as text: a few panels, log-scale axes).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/engine.h"
#include "sim.h"

namespace kvbridge::cli {
namespace {

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Right-aligned cells of fixed widths.
std::string row(const std::vector<std::pair<int, std::string>>& cells) {
  std::string out;
  for (const auto& [width, text] : cells) {
    std::string cell = text;
    if (static_cast<int>(cell.size()) < width) cell.insert(0, width - cell.size(), ' ');
    out += cell + " ";
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out + "\n";
}

std::string kb(double bytes) { return fmt("%.1f", bytes / 1000); }

}  // namespace

std::string sim_table(const SimReport& r) {
  const SimOptions& o = r.options;
  std::string out;
  out += "kvbridge sim: " + o.preset + ", prefill TP " + std::to_string(o.prefill_tp) + ", decode TP " +
         std::to_string(o.decode_tp) + "; " + std::to_string(o.requests) + " requests per point at " +
         fmt("%g", o.rate) + "/s (" + fmt("%.1f", r.duration_s) + " s), prompts mean " +
         fmt("%.0f", r.mean_prompt_tokens) + " tokens (cut at " + std::to_string(r.max_prompt_tokens) + "), reuse " +
         fmt("%.2f", o.reuse) + ", seed " + std::to_string(o.seed) + "\n";
  std::string src, rd;
  for (uint32_t s : r.sources_of_rank) src += (src.empty() ? "" : " ") + std::to_string(s);
  for (uint32_t s : r.readers_of_rank) rd += (rd.empty() ? "" : " ") + std::to_string(s);
  out += "planner: decode ranks read " + src + " of the " + std::to_string(o.prefill_tp) +
         " ranks of a prefill instance; prefill ranks are read by " + rd + " of the " + std::to_string(o.decode_tp) +
         " ranks of a decode instance\n";
  out += "handshake (measured): layout JSON " + std::to_string(r.layout_json_bytes) + " B + engine metadata (" +
         o.transport + ") " + std::to_string(r.engine_metadata_bytes) + " B; Metadata frame " +
         std::to_string(r.metadata_frame_bytes) + " B per prefill rank (rank 0)\n\n";

  out +=
      "handshakes = connections kept, per rank. Routing 'pinned': each decode instance reads K fixed prefill\n"
      "instances (--pinned " +
      std::to_string(o.pinned) +
      ", or as many as cover them all); 'any': any with any. 'today': the\n"
      "connector fetches every rank of a prefill instance it loads from. bound: sources x the prefill instances it can "
      "read\n";
  out += row({{6, "ranks"},
              {5, "P"},
              {5, "D"},
              {7, "src/D"},
              {3, "K"},
              {8, "pinned"},
              {8, "any"},
              {6, "max"},
              {7, "bound"},
              {9, "today"},
              {9, "in/P pin"},
              {8, "in/P any"},
              {6, "max"},
              {7, "bound"},
              {7, "today"},
              {10, "total pin"},
              {10, "total any"}});
  for (const SimPoint& p : r.points) {
    out += row({{6, std::to_string(p.ranks)},
                {5, std::to_string(p.prefill_instances)},
                {5, std::to_string(p.decode_instances)},
                {7, fmt("%.1f", p.sources)},
                {3, std::to_string(p.pinned_group)},
                {8, fmt("%.1f", p.hs_pinned_mean)},
                {8, fmt("%.1f", p.hs_any_mean)},
                {6, fmt("%.0f", p.hs_any_max)},
                {7, fmt("%.0f", p.hs_any_bound)},
                {9, fmt("%.1f", p.hs_today_any_mean)},
                {9, fmt("%.1f", p.in_pinned_mean)},
                {8, fmt("%.1f", p.in_any_mean)},
                {6, fmt("%.0f", p.in_any_max)},
                {7, fmt("%.0f", p.in_any_bound)},
                {7, fmt("%.0f", p.in_today_any_max)},
                {10, std::to_string(p.total_connections_pinned)},
                {10, std::to_string(p.total_connections_any)}});
  }

  out += "first bounds: a prefill rank's tcp server keeps " + std::to_string(kTcpServerStreams) +
         " streams, a reading decode rank opens up to " + std::to_string(EngineOptions{}.tcp_streams) + " (so " +
         std::to_string(kTcpServerStreams / EngineOptions{}.tcp_streams) +
         " readers per prefill rank); its control channel takes " + std::to_string(kControlInbound) +
         " inbound connections\n";
  out +=
      "\nhandshake bytes received per rank, KB (decode: Metadata frames and control Accepts; prefill: Open frames),\n"
      "planning CPU per request on one decode rank (plan(), measured), etcd operations per second (a model)\n";
  out += row({{6, "ranks"},
              {8, "D pin"},
              {8, "D any"},
              {9, "D today"},
              {7, "P any"},
              {9, "plan p50"},
              {7, "p99 us"},
              {7, "descr"},
              {8, "etcd wr"},
              {8, "keepal"},
              {8, "events"},
              {7, "lists"}});
  for (const SimPoint& p : r.points) {
    out += row({{6, std::to_string(p.ranks)},
                {8, kb(p.meta_pinned_bytes)},
                {8, kb(p.meta_any_bytes)},
                {9, kb(p.meta_today_any_bytes)},
                {7, kb(p.meta_prefill_any_bytes)},
                {9, fmt("%.0f", p.plan_p50_us)},
                {7, fmt("%.0f", p.plan_p99_us)},
                {7, fmt("%.0f", p.plan_descriptors_mean)},
                {8, fmt("%.3f", p.etcd.writes)},
                {8, fmt("%.1f", p.etcd.keepalives)},
                {8, fmt("%.2f", p.etcd.events)},
                {7, fmt("%.3f", p.etcd.lists)}});
  }
  out += "etcd (a model of the discovery scheme, not a measurement of etcd): one key per instance under a " +
         fmt("%g", o.lease_ttl_s) + " s lease, keep-alive every TTL/3; the decode instances and " +
         std::to_string(o.routers) + " router(s) watch the prefix; each instance leaves and rejoins " +
         fmt("%g", o.churn_per_hour) + " time(s) an hour\n";

  out += "\nprefix store on a Redis Cluster (slot = CRC16(key) mod 16384, slots split evenly): hash block " +
         std::to_string(r.hash_block_tokens) + " tokens, object " + fmt("%.2f", r.object_bytes / 1e6) +
         " MB per hash block (estimated from the layout), " + fmt("%g", o.store_node_gib) +
         " GiB per master; reused tokens " + fmt("%.3f", r.reuse_upper_bound) +
         " of all (an unbounded store's hit rate)\n";
  out += row({{6, "nodes"},
              {11, "ops/s max"},
              {9, "mean"},
              {8, "max/mean"},
              {10, "keys min"},
              {9, "max"},
              {9, "hit rate"},
              {10, "evictions"}});
  for (const SimStoreRow& s : r.store) {
    out += row({{6, std::to_string(s.nodes)},
                {11, fmt("%.1f", s.ops_per_s_max)},
                {9, fmt("%.1f", s.ops_per_s_mean)},
                {8, fmt("%.3f", s.ops_per_s_max / std::max(s.ops_per_s_mean, 1e-9))},
                {10, std::to_string(s.keys_min)},
                {9, std::to_string(s.keys_max)},
                {9, fmt("%.3f", s.hit_rate)},
                {10, std::to_string(s.evictions)}});
  }
  return out;
}

std::string sim_json(const SimReport& r) {
  const SimOptions& o = r.options;
  nlohmann::ordered_json j;
  j["format"] = "kvbridge.sim/1";
  j["options"] = {{"preset", o.preset},
                  {"prefill_tp", o.prefill_tp},
                  {"decode_tp", o.decode_tp},
                  {"requests", o.requests},
                  {"rate", o.rate},
                  {"prompt_tokens", o.prompt_tokens},
                  {"reuse", o.reuse},
                  {"seed", o.seed},
                  {"pinned", o.pinned},
                  {"transport", o.transport},
                  {"plan_samples", o.plan_samples},
                  {"store_node_gib", o.store_node_gib},
                  {"lease_ttl_s", o.lease_ttl_s},
                  {"churn_per_hour", o.churn_per_hour},
                  {"routers", o.routers}};
  j["sources_of_rank"] = r.sources_of_rank;
  j["readers_of_rank"] = r.readers_of_rank;
  j["layout_json_bytes"] = r.layout_json_bytes;
  j["engine_metadata_bytes"] = r.engine_metadata_bytes;
  j["metadata_frame_bytes"] = r.metadata_frame_bytes;
  j["identity_text_bytes"] = r.identity_text_bytes;
  j["hash_block_tokens"] = r.hash_block_tokens;
  j["object_bytes"] = r.object_bytes;
  j["object_bytes_estimated"] = true;
  j["max_prompt_tokens"] = r.max_prompt_tokens;
  j["mean_prompt_tokens"] = r.mean_prompt_tokens;
  j["duration_s"] = r.duration_s;
  j["reuse_upper_bound"] = r.reuse_upper_bound;
  j["etcd_is_model"] = true;
  j["tcp_server_streams"] = kTcpServerStreams;
  j["tcp_streams_per_reader"] = EngineOptions{}.tcp_streams;
  j["control_inbound"] = kControlInbound;
  nlohmann::ordered_json points = nlohmann::ordered_json::array();
  for (const SimPoint& p : r.points) {
    points.push_back({{"ranks", p.ranks},
                      {"prefill_instances", p.prefill_instances},
                      {"decode_instances", p.decode_instances},
                      {"sources_per_decode_rank", p.sources},
                      {"pinned_group", p.pinned_group},
                      {"handshakes_per_decode_rank_pinned", p.hs_pinned_mean},
                      {"handshakes_per_decode_rank_pinned_max", p.hs_pinned_max},
                      {"handshakes_per_decode_rank_pinned_bound", p.hs_pinned_bound},
                      {"handshakes_per_decode_rank_any", p.hs_any_mean},
                      {"handshakes_per_decode_rank_any_max", p.hs_any_max},
                      {"handshakes_per_decode_rank_any_bound", p.hs_any_bound},
                      {"handshakes_per_decode_rank_today_any", p.hs_today_any_mean},
                      {"handshakes_per_decode_rank_today_pinned", p.hs_today_pinned_mean},
                      {"connections_per_prefill_rank_pinned", p.in_pinned_mean},
                      {"connections_per_prefill_rank_pinned_max", p.in_pinned_max},
                      {"connections_per_prefill_rank_any", p.in_any_mean},
                      {"connections_per_prefill_rank_any_max", p.in_any_max},
                      {"connections_per_prefill_rank_any_bound", p.in_any_bound},
                      {"connections_per_prefill_rank_today_any_max", p.in_today_any_max},
                      {"total_connections_pinned", p.total_connections_pinned},
                      {"total_connections_any", p.total_connections_any},
                      {"metadata_bytes_per_decode_rank_pinned", p.meta_pinned_bytes},
                      {"metadata_bytes_per_decode_rank_any", p.meta_any_bytes},
                      {"metadata_bytes_per_decode_rank_today_any", p.meta_today_any_bytes},
                      {"handshake_bytes_per_prefill_rank_any", p.meta_prefill_any_bytes},
                      {"plan_p50_us", p.plan_p50_us},
                      {"plan_p99_us", p.plan_p99_us},
                      {"plan_descriptors_mean", p.plan_descriptors_mean},
                      {"etcd_writes_per_s", p.etcd.writes},
                      {"etcd_keepalives_per_s", p.etcd.keepalives},
                      {"etcd_watch_events_per_s", p.etcd.events},
                      {"etcd_lists_per_s", p.etcd.lists},
                      {"etcd_list_keys_per_s", p.etcd.list_keys}});
  }
  j["points"] = std::move(points);
  nlohmann::ordered_json store = nlohmann::ordered_json::array();
  for (const SimStoreRow& s : r.store) {
    store.push_back({{"nodes", s.nodes},
                     {"capacity_objects", s.capacity_objects},
                     {"ops_per_s_max", s.ops_per_s_max},
                     {"ops_per_s_mean", s.ops_per_s_mean},
                     {"keys_min", s.keys_min},
                     {"keys_max", s.keys_max},
                     {"hit_rate", s.hit_rate},
                     {"evictions", s.evictions}});
  }
  j["store"] = std::move(store);
  return j.dump(2);
}

namespace {

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;
  bool dashed = false;
};

std::string num(double v) { return fmt("%.1f", v); }

std::string tick_label(double v) {
  if (v >= 1e6) return fmt("%gM", v / 1e6);
  if (v >= 1e3) return fmt("%gk", v / 1e3);
  return fmt("%g", v);
}

// One panel at (x0, y0), w x h: log x; log y when asked (values <= 0 are
// left out), else linear from 0.
std::string panel(double x0, double y0, double w, double h, const std::string& title, const std::string& xlabel,
                  const std::string& ylabel, const std::vector<Series>& series, bool log_y) {
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (const Series& s : series) {
    for (auto [x, y] : s.points) {
      if (x <= 0 || (log_y && y <= 0)) continue;
      xmin = std::min(xmin, x), xmax = std::max(xmax, x);
      ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  }
  if (!(xmin < INFINITY)) return "";
  if (xmax <= xmin) xmax = xmin * 2;
  double ly0, ly1;
  if (log_y) {
    ly0 = std::floor(std::log10(ymin));
    ly1 = std::ceil(std::log10(ymax));
    if (ly1 <= ly0) ly1 = ly0 + 1;
  } else {
    ly0 = 0;
    ly1 = ymax <= 0 ? 1 : ymax * 1.1;
  }
  const double lx0 = std::log2(xmin), lx1 = std::log2(xmax);
  const double left = x0 + 62, right = x0 + w - 12, top = y0 + 28, bottom = y0 + h - 58;
  auto px = [&](double x) { return left + (std::log2(x) - lx0) / (lx1 - lx0) * (right - left); };
  auto py = [&](double y) {
    const double v = log_y ? std::log10(y) : y;
    return bottom - (v - ly0) / (ly1 - ly0) * (bottom - top);
  };
  std::string out;
  out += "<g>\n<text x=\"" + num(x0 + w / 2) + "\" y=\"" + num(y0 + 16) +
         "\" text-anchor=\"middle\" font-size=\"13\" font-weight=\"bold\">" + title + "</text>\n";
  out += "<rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" + num(right - left) + "\" height=\"" +
         num(bottom - top) + "\" fill=\"none\" stroke=\"#888\"/>\n";
  // y ticks: powers of ten (log) or five steps (linear).
  std::vector<double> yt;
  if (log_y) {
    for (double e = ly0; e <= ly1 + 1e-9; ++e) yt.push_back(std::pow(10, e));
  } else {
    const double step = std::pow(10, std::floor(std::log10(ly1 / 5)));
    const double nice =
        ly1 / step <= 10 ? step : (ly1 / step <= 20 ? 2 * step : (ly1 / step <= 50 ? 5 * step : 10 * step));
    for (double v = 0; v <= ly1 + 1e-9; v += nice) yt.push_back(v);
  }
  for (double v : yt) {
    out += "<line x1=\"" + num(left) + "\" x2=\"" + num(right) + "\" y1=\"" + num(py(v)) + "\" y2=\"" + num(py(v)) +
           "\" stroke=\"#eee\"/>\n";
    out += "<text x=\"" + num(left - 4) + "\" y=\"" + num(py(v) + 4) + "\" text-anchor=\"end\" font-size=\"10\">" +
           tick_label(v) + "</text>\n";
  }
  // x ticks at the points of the first series.
  for (auto [x, y] : series.front().points) {
    out += "<text x=\"" + num(px(x)) + "\" y=\"" + num(bottom + 13) + "\" text-anchor=\"middle\" font-size=\"10\">" +
           tick_label(x) + "</text>\n";
  }
  out += "<text x=\"" + num((left + right) / 2) + "\" y=\"" + num(bottom + 27) +
         "\" text-anchor=\"middle\" font-size=\"11\">" + xlabel + "</text>\n";
  out += "<text transform=\"translate(" + num(x0 + 14) + "," + num((top + bottom) / 2) +
         ") rotate(-90)\" text-anchor=\"middle\" font-size=\"11\">" + ylabel + "</text>\n";
  double lx = left;
  for (const Series& s : series) {
    std::string pts;
    for (auto [x, y] : s.points) {
      if (x <= 0 || (log_y && y <= 0)) continue;
      pts += num(px(x)) + "," + num(py(y)) + " ";
    }
    out += "<polyline fill=\"none\" stroke=\"" + s.color + "\" stroke-width=\"2\"" +
           (s.dashed ? " stroke-dasharray=\"5,3\"" : "") + " points=\"" + pts + "\"/>\n";
    for (auto [x, y] : s.points) {
      if (x <= 0 || (log_y && y <= 0)) continue;
      out += "<circle cx=\"" + num(px(x)) + "\" cy=\"" + num(py(y)) + "\" r=\"2.5\" fill=\"" + s.color + "\"/>\n";
    }
    // The legend below the axis label.
    out += "<line x1=\"" + num(lx) + "\" x2=\"" + num(lx + 14) + "\" y1=\"" + num(bottom + 41) + "\" y2=\"" +
           num(bottom + 41) + "\" stroke=\"" + s.color + "\" stroke-width=\"2\"" +
           (s.dashed ? " stroke-dasharray=\"5,3\"" : "") + "/>\n";
    out += "<text x=\"" + num(lx + 17) + "\" y=\"" + num(bottom + 45) + "\" font-size=\"10\">" + s.name + "</text>\n";
    lx += 24 + 6.0 * s.name.size();
  }
  return out + "</g>\n";
}

}  // namespace

std::string sim_svg(const SimReport& r) {
  const SimOptions& o = r.options;
  auto series = [&](const std::string& name, const std::string& color, auto get, bool dashed = false) {
    Series s{name, color, {}, dashed};
    for (const SimPoint& p : r.points) s.points.emplace_back(p.ranks, get(p));
    return s;
  };
  const double w = 470, h = 300;
  const std::string xr = "total ranks (log scale)";
  std::string body;
  body += panel(0, 40, w, h, "Handshakes per decode rank", xr, "handshakes (log)",
                {series("pinned", "#1f77b4", [](const SimPoint& p) { return p.hs_pinned_mean; }),
                 series("any", "#d62728", [](const SimPoint& p) { return p.hs_any_mean; }),
                 series(
                     "any bound", "#d62728", [](const SimPoint& p) { return p.hs_any_bound; }, true),
                 series(
                     "today, any", "#7f7f7f", [](const SimPoint& p) { return p.hs_today_any_mean; }, true)},
                true);
  body += panel(w, 40, w, h, "Handshake KB received per decode rank", xr, "KB (log)",
                {series("pinned", "#1f77b4", [](const SimPoint& p) { return p.meta_pinned_bytes / 1000; }),
                 series("any", "#d62728", [](const SimPoint& p) { return p.meta_any_bytes / 1000; }),
                 series(
                     "today, any", "#7f7f7f", [](const SimPoint& p) { return p.meta_today_any_bytes / 1000; }, true)},
                true);
  body += panel(0, 40 + h, w, h, "Connections per prefill rank (inbound)", xr, "connections (log)",
                {series("pinned mean", "#1f77b4", [](const SimPoint& p) { return p.in_pinned_mean; }),
                 series("any mean", "#d62728", [](const SimPoint& p) { return p.in_any_mean; }),
                 series(
                     "any max", "#d62728", [](const SimPoint& p) { return p.in_any_max; }, true),
                 series(
                     "today, any max", "#7f7f7f", [](const SimPoint& p) { return p.in_today_any_max; }, true),
                 series(
                     "tcp bound", "#000000",
                     [](const SimPoint&) { return double(kTcpServerStreams / EngineOptions{}.tcp_streams); }, true)},
                true);
  body += panel(w, 40 + h, w, h, "plan() per request, one decode rank (measured)", xr, "microseconds",
                {series("p50", "#2ca02c", [](const SimPoint& p) { return p.plan_p50_us; }),
                 series(
                     "p99", "#2ca02c", [](const SimPoint& p) { return p.plan_p99_us; }, true)},
                false);
  body += panel(0, 40 + 2 * h, w, h, "etcd operations per second (a model)", xr, "ops/s (log)",
                {series("keep-alives", "#9467bd", [](const SimPoint& p) { return p.etcd.keepalives; }),
                 series("watch events", "#8c564b", [](const SimPoint& p) { return p.etcd.events; }),
                 series(
                     "writes", "#e377c2", [](const SimPoint& p) { return p.etcd.writes; }, true)},
                true);
  {
    Series mx{"max per master", "#ff7f0e", {}, false}, mean{"mean per master", "#ff7f0e", {}, true};
    Series hit{"hit rate x 1000", "#17becf", {}, false};
    for (const SimStoreRow& s : r.store) {
      mx.points.emplace_back(s.nodes, s.ops_per_s_max);
      mean.points.emplace_back(s.nodes, s.ops_per_s_mean);
      hit.points.emplace_back(s.nodes, s.hit_rate * 1000);
    }
    body += panel(w, 40 + 2 * h, w, h, "Prefix store: ops/s per Redis master", "Redis Cluster masters (log scale)",
                  "ops/s (log)", {mx, mean, hit}, true);
  }
  const std::string title = "kvbridge sim: " + o.preset + ", prefill TP " + std::to_string(o.prefill_tp) +
                            ", decode TP " + std::to_string(o.decode_tp) + ", " + std::to_string(o.requests) +
                            " requests per point, reuse " + fmt("%.2f", o.reuse) + ", seed " + std::to_string(o.seed);
  std::string out = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(2 * w) + "\" height=\"" +
                    num(40 + 3 * h) + "\" viewBox=\"0 0 " + num(2 * w) + " " + num(40 + 3 * h) +
                    "\" font-family=\"sans-serif\">\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += "<text x=\"" + num(w) + "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" + title + "</text>\n";
  return out + body + "</svg>\n";
}

}  // namespace kvbridge::cli

// Table, JSON, targets and chart of `kvbridge bench`.
#include "bench_report.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "bench_peer.h"

namespace kvbridge::cli::bench {
namespace {

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string size_name(uint64_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + "MiB";
  if (bytes >= 1024 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + "KiB";
  return std::to_string(bytes);
}

// The device targets, for each cuda_ipc method that has rows.
void print_device_targets(std::ostream& out, const std::vector<BenchRow>& rows) {
  std::vector<std::string> methods;
  for (const BenchRow& r : rows) {
    if (r.transport.rfind("cuda_ipc", 0) == 0 &&
        std::find(methods.begin(), methods.end(), r.transport) == methods.end()) {
      methods.push_back(r.transport);
    }
  }
  auto verdict = [](bool measured, bool met) { return !measured ? "n/a" : met ? "met" : "MISSED"; };
  for (const std::string& m : methods) {
    // 10,000 x 16 KiB in one transfer against one contiguous cudaMemcpy.
    const BenchRow* big = nullptr;
    double small_worst = 0, rw_worst = 0, fixed_worst = 0;
    const BenchRow *small_row = nullptr, *rw_row = nullptr, *fixed_row = nullptr;
    for (const BenchRow& r : rows) {
      if (r.transport != m) continue;
      if (r.block_bytes == 16384 && r.batch == 10000 && (!big || r.ratio < big->ratio)) big = &r;
      if (r.block_bytes <= 16384 && r.batch >= 100 && r.per_copy_ratio > 0 &&
          (!small_row || r.per_copy_ratio < small_worst)) {
        small_row = &r;
        small_worst = r.per_copy_ratio;
      }
      if (r.batch == 1 && (!fixed_row || r.latency_us > fixed_worst)) {
        fixed_row = &r;
        fixed_worst = r.latency_us;
      }
      if (r.op != "read") continue;
      for (const BenchRow& w : rows) {
        if (w.transport != m || w.op != "write" || w.block_bytes != r.block_bytes || w.batch != r.batch ||
            w.pattern != r.pattern || r.gbps <= 0 || w.gbps <= 0)
          continue;
        const double gap = std::max(r.gbps, w.gbps) / std::min(r.gbps, w.gbps) - 1;
        if (!rw_row || gap > rw_worst) {
          rw_row = &r;
          rw_worst = gap;
        }
      }
    }
    auto where = [](const BenchRow* r) {
      return r ? " (" + r->op + " " + size_name(r->block_bytes) + " " + r->pattern + " batch " +
                     std::to_string(r->batch) + ")"
               : std::string();
    };
    out << "  " << m << " 10,000 x 16 KiB >= 0.70 x one contiguous cudaMemcpy: "
        << (big ? fixed(big->ratio, 2) + where(big) : "no row") << ": " << verdict(big, big && big->ratio >= 0.7)
        << "\n";
    out << "  " << m << " blocks of 2-16 KiB, batches of 100+, >= 20 x one cudaMemcpyAsync per descriptor: worst "
        << (small_row ? fixed(small_worst, 2) + where(small_row) : "no row") << ": "
        << verdict(small_row, small_row && small_worst >= 20) << "\n";
    out << "  " << m << " reads and writes within 10%: worst gap "
        << (rw_row ? fixed(rw_worst * 100, 1) + "%" + where(rw_row) : "no pair") << ": "
        << verdict(rw_row, rw_row && rw_worst <= 0.10) << "\n";
    out << "  " << m << " fixed cost (batch of 1) <= 15 us: worst "
        << (fixed_row ? fixed(fixed_worst, 1) + " us" + where(fixed_row) : "no row") << ": "
        << verdict(fixed_row, fixed_row && fixed_worst <= 15) << "\n";
  }
}

}  // namespace

void print_table(std::ostream& out, const std::vector<BenchRow>& rows) {
  std::vector<std::vector<std::string>> cells = {{"transport", "op", "block_bytes", "pattern", "batch", "gbps",
                                                  "latency_us", "baseline", "baseline_gbps", "ratio"}};
  // Device rows have a second baseline: one cudaMemcpyAsync per descriptor.
  const bool per_copy = std::any_of(rows.begin(), rows.end(), [](const BenchRow& r) { return r.per_copy_gbps > 0; });
  if (per_copy) {
    cells[0].push_back("per_copy_gbps");
    cells[0].push_back("per_copy_ratio");
  }
  for (const BenchRow& r : rows) {
    cells.push_back({r.transport, r.op, std::to_string(r.block_bytes), r.pattern, std::to_string(r.batch),
                     fixed(r.gbps, 2), fixed(r.latency_us, 1), r.baseline.empty() ? "-" : r.baseline,
                     r.baseline_gbps > 0 ? fixed(r.baseline_gbps, 2) : "-", r.ratio > 0 ? fixed(r.ratio, 2) : "-"});
    if (per_copy) {
      cells.back().push_back(r.per_copy_gbps > 0 ? fixed(r.per_copy_gbps, 2) : "-");
      cells.back().push_back(r.per_copy_ratio > 0 ? fixed(r.per_copy_ratio, 2) : "-");
    }
  }
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& line : cells)
    for (size_t i = 0; i < line.size(); ++i) width[i] = std::max(width[i], line[i].size());
  for (const auto& line : cells) {
    for (size_t i = 0; i < line.size(); ++i) {
      // Text columns left-aligned, numbers right-aligned.
      const bool text = i == 0 || i == 1 || i == 3 || i == 7;
      out << (i ? "  " : "") << (text ? std::left : std::right) << std::setw(static_cast<int>(width[i])) << line[i];
    }
    out << "\n";
  }
  out << std::right;
}

std::string rows_json(const std::vector<BenchRow>& rows) {
  nlohmann::json a = nlohmann::json::array();
  for (const BenchRow& r : rows) {
    nlohmann::json o = {{"transport", r.transport},
                        {"op", r.op},
                        {"block_bytes", r.block_bytes},
                        {"pattern", r.pattern},
                        {"batch", r.batch},
                        {"gbps", r.gbps},
                        {"latency_us", r.latency_us},
                        {"baseline", r.baseline},
                        {"baseline_gbps", r.baseline_gbps},
                        {"ratio", r.ratio}};
    if (r.transport == "tcp") {
      o["ucx_tcp_gbps"] = r.ucx_tcp_gbps;
      o["ucx_tcp_ratio"] = r.ucx_tcp_ratio;
    }
    if (r.per_copy_gbps > 0) {
      o["per_copy_gbps"] = r.per_copy_gbps;
      o["per_copy_ratio"] = r.per_copy_ratio;
    }
    a.push_back(std::move(o));
  }
  return a.dump(1);
}

void print_targets(std::ostream& out, const std::vector<BenchRow>& rows, double iperf3, double ucx_tcp) {
  auto verdict = [](bool measured, bool met) { return !measured ? "n/a" : met ? "met" : "MISSED"; };
  auto worst = [&](const std::string& transport, auto filter) {
    const BenchRow* w = nullptr;
    for (const BenchRow& r : rows) {
      if (r.transport == transport && r.ratio > 0 && filter(r) && (!w || r.ratio < w->ratio)) w = &r;
    }
    return w;
  };
  // The worst row (with its baseline's name when `named`).
  auto describe = [](const BenchRow* r, bool named = false) {
    if (!r) return std::string("no rows");
    return "worst " + fixed(r->ratio, 2) + " (" + r->op + " " + size_name(r->block_bytes) + " " + r->pattern +
           " batch " + std::to_string(r->batch) + ": " + fixed(r->gbps, 2) + " vs " + fixed(r->baseline_gbps, 2) +
           " Gbit/s" + (named ? " " + r->baseline : std::string()) + ")";
  };
  // The worst row, and how many of the target's rows reach `at_least`.
  auto describe_rows = [&](const BenchRow* r, const std::string& transport, auto filter, double at_least) {
    if (!r) return std::string("no rows");
    size_t n = 0, met = 0;
    for (const BenchRow& x : rows) {
      if (x.transport != transport || x.ratio <= 0 || !filter(x)) continue;
      ++n;
      if (x.ratio >= at_least) ++met;
    }
    return describe(r, true) + ", " + std::to_string(met) + " of " + std::to_string(n) + " rows met";
  };
  out << "targets:\n";
  auto has = [&](const std::string& transport) {
    return std::any_of(rows.begin(), rows.end(), [&](const BenchRow& r) { return r.transport == transport; });
  };
  print_device_targets(out, rows);
  if (!has("local") && !has("cma") && !has("tcp") && !has("ucx")) return;
  auto big = [](const BenchRow& r) { return r.block_bytes >= 65536; };
  auto all = [](const BenchRow&) { return true; };
  const BenchRow* w = worst("local", big);
  out << "  local >= 0.90 x memcpy, blocks >= 64 KiB: " << describe_rows(w, "local", big, 0.9) << ": "
      << verdict(w, w && w->ratio >= 0.9) << "\n";
  w = worst("cma", all);
  out << "  cma >= 0.90 x raw process_vm_readv/writev: " << describe_rows(w, "cma", all, 0.9) << ": "
      << verdict(w, w && w->ratio >= 0.9) << "\n";
  // tcp is judged on its bulk row: reads of the largest block, contiguous, at
  // the largest batch (the shape of iperf3's stream and of ucp_get 1 MiB).
  const BenchRow* best = nullptr;
  for (const BenchRow& r : rows) {
    if (r.transport != "tcp" || r.op != "read" || r.pattern != "contiguous") continue;
    if (!best || r.block_bytes > best->block_bytes || (r.block_bytes == best->block_bytes && r.batch > best->batch))
      best = &r;
  }
  const double tcp_best = best ? best->gbps : 0;
  const std::string where =
      best ? " (read " + size_name(best->block_bytes) + " contiguous batch " + std::to_string(best->batch) + ")" : "";
  // Against one baseline figure: "no rows" without a tcp bulk row.
  auto against = [&](double baseline, double factor, bool say_where) {
    if (!best) return std::string("no rows: n/a");
    return fixed(tcp_best, 2) + " vs " + fixed(baseline, 2) +
           " Gbit/s = " + (baseline > 0 ? fixed(tcp_best / baseline, 2) : "-") + (say_where ? where : "") + ": " +
           verdict(baseline > 0, baseline > 0 && tcp_best >= factor * baseline);
  };
  out << "  tcp >= 0.80 x iperf3 single stream: " << against(iperf3, 0.8, true) << "\n";
  out << "  tcp >= 2 x ucx_perftest ucp_get UCX_TLS=tcp 1 MiB: " << against(ucx_tcp, 2.0, false) << "\n";
  w = worst("ucx", all);
  out << "  ucx >= 0.90 x ucx_perftest: " << describe_rows(w, "ucx", all, 0.9) << ": "
      << verdict(w, w && w->ratio >= 0.9) << "\n";
  for (const char* t : {"local", "cma", "tcp", "ucx"}) {
    w = worst(t, [](const BenchRow& r) { return r.block_bytes == 2048 && r.batch == 10000; });
    if (!w) continue;
    out << "  " << t << " batch of 10,000 x 2 KiB >= 0.90 x baseline: " << describe(w) << ": "
        << verdict(true, w->ratio >= 0.9) << "\n";
  }
}

Status plot_png(const std::vector<BenchRow>& rows, const std::string& png) {
  if (!have_program("gnuplot")) return Status::unavailable("gnuplot is not installed (Debian: gnuplot-nox)");
  std::vector<std::string> transports;
  for (const BenchRow& r : rows) {
    if (std::find(transports.begin(), transports.end(), r.transport) == transports.end())
      transports.push_back(r.transport);
  }
  if (transports.empty()) return Status::invalid_argument("bench: nothing to plot");
  std::ostringstream g;
  g << "set terminal pngcairo size 1400," << 380 * transports.size() << " font 'sans,10' noenhanced\n";
  g << "set output '" << png << "'\n";
  g << "set multiplot layout " << transports.size()
    << ",2 title 'kvbridge bench: engine (solid: contiguous, "
       "dashed: shuffled) vs baseline (dotted, contiguous)'\n";
  g << "set logscale x 2\nset grid\nset key outside right top\nset ylabel 'Gbit/s (log)'\nset logscale y 10\n";
  int block_id = 0;
  for (const std::string& t : transports) {
    // Panel 1: against block size, each block at its largest batch.
    // Panel 2: against batch, at the smallest block size.
    std::map<uint64_t, uint64_t> max_batch;
    uint64_t min_block = UINT64_MAX;
    for (const BenchRow& r : rows) {
      if (r.transport != t) continue;
      max_batch[r.block_bytes] = std::max(max_batch[r.block_bytes], r.batch);
      min_block = std::min(min_block, r.block_bytes);
    }
    for (int panel = 0; panel < 2; ++panel) {
      std::vector<std::string> plots;
      std::string baseline_name;
      for (const char* op : {"read", "write"}) {
        for (const char* pattern : {"contiguous", "shuffled"}) {
          const std::string name = "$d" + std::to_string(block_id++);
          g << name << " << EOD\n";
          for (const BenchRow& r : rows) {
            if (r.transport != t || r.op != op || r.pattern != pattern) continue;
            if (panel == 0 && r.batch != max_batch[r.block_bytes]) continue;
            if (panel == 1 && r.block_bytes != min_block) continue;
            g << (panel == 0 ? r.block_bytes / 1024.0 : static_cast<double>(r.batch)) << " " << r.gbps << " "
              << r.baseline_gbps << "\n";
            if (!r.baseline.empty()) baseline_name = r.baseline;
          }
          g << "EOD\n";
          const std::string color = std::string(op) == "read" ? "'#1f77b4'" : "'#d62728'";
          const bool shuffled = std::string(pattern) == "shuffled";
          plots.push_back(name + " using 1:2 with linespoints lw 2 pt 7 dt " + (shuffled ? "2" : "1") + " lc rgb " +
                          color + " title '" + op + " " + pattern + "'");
          if (!shuffled) {
            plots.push_back(name + " using 1:($3 > 0 ? $3 : 1/0) with linespoints lw 1 pt 6 dt 3 lc rgb " + color +
                            " title '" + op + " baseline'");
          }
        }
      }
      if (panel == 0) {
        g << "set xlabel 'block size (KiB), at the largest batch'\n";
      } else {
        g << "set xlabel 'batch (descriptors), " << size_name(min_block) << " blocks'\n";
      }
      g << "set title '" << t << (baseline_name.empty() ? "" : " vs " + baseline_name) << "'\n";
      g << "plot ";
      for (size_t i = 0; i < plots.size(); ++i) g << (i ? ", " : "") << plots[i];
      g << "\n";
    }
  }
  g << "unset multiplot\n";
  char path[] = "/tmp/kvbridge-bench-XXXXXX.gp";
  const int fd = ::mkstemps(path, 3);
  if (fd < 0) return Status::io_error("bench: cannot create a temporary gnuplot script");
  ::close(fd);
  {
    std::ofstream f(path);
    f << g.str();
  }
  const ShellOutput r = run_shell(std::string("exec timeout 60 gnuplot ") + path);
  ::unlink(path);
  if (!r.ok) return Status::io_error("bench: gnuplot failed to write '" + png + "'");
  return Status();
}

}  // namespace kvbridge::cli::bench

// tools/bench_report.h: how `kvbridge bench` shows its rows: an aligned
// table, a JSON array, a verdict per target, and a PNG chart
// drawn by gnuplot.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "bench.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::bench {

void print_table(std::ostream& out, const std::vector<BenchRow>& rows);
// One JSON array, one object per row (transport, op, block_bytes, pattern,
// batch, gbps, latency_us, baseline, baseline_gbps, ratio; tcp rows add
// ucx_tcp_gbps and ucx_tcp_ratio).
std::string rows_json(const std::vector<BenchRow>& rows);
// One line per target: the figure it is judged on, and met / MISSED / n/a.
void print_targets(std::ostream& out, const std::vector<BenchRow>& rows, double iperf3_gbps, double ucx_tcp_gbps);
// Writes `png` with gnuplot: per transport, Gbit/s against block size (at
// the largest batch) and against batch (at the smallest block), engine
// solid or dashed, baseline dotted, log scales. kUnavailable when gnuplot is missing.
Status plot_png(const std::vector<BenchRow>& rows, const std::string& png);

}  // namespace kvbridge::cli::bench

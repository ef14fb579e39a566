// tools/bench.h: what the pieces of `kvbridge bench` share.
//
// The benchmark measures the engine (include/kvbridge/engine.h) moving
// KV-shaped batches -- fixed-size blocks, contiguous or shuffled block ids --
// over each transport, next to a baseline that moves the same bytes without
// the engine (memcpy, raw process_vm_readv/writev with the same iovecs,
// iperf3, ucx_perftest). Throughput is in gigabits per second (10^9 bit/s),
// as iperf3 reports it; latency is the wall time of one submit() + wait().
//
// Pieces: bench_workload (block ids and items), bench_peer (the second
// process), bench_baselines (the non-engine measurements), bench_report
// (table, JSON, chart), cmd_bench.cc (the command that runs them).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/engine.h"

namespace kvbridge::cli::bench {

struct BenchArgs {
  std::vector<std::string> transports = {"local", "cma", "tcp", "ucx"};
  std::vector<uint64_t> block_bytes = {2048, 16384, 65536, 262144};
  std::vector<uint64_t> batches = {1, 100, 10000};
  std::vector<std::string> patterns = {"contiguous", "shuffled"};
  std::vector<std::string> ops = {"read", "write"};
  uint64_t buffer_bytes = uint64_t{256} << 20;           // per side
  double min_seconds = 0.1;                              // per repetition
  uint32_t reps = 5;                                     // the median is reported
  uint32_t threads = 2;                                  // EngineOptions::threads
  uint64_t inline_bytes = EngineOptions{}.inline_bytes;  // EngineOptions::inline_bytes
  uint32_t tcp_streams = 4;                              // EngineOptions::tcp_streams
  uint32_t iperf_seconds = 3;
  bool quick = false;
  bool json = false;
  // "host", or "cuda": the cuda_ipc rows (bench_device.cc), device memory on
  // both sides, once per copy method in `device_copies`.
  std::string memory = "host";
  std::vector<std::string> device_copies = {"copy_engine", "kernel"};
  std::string plot;  // PNG path; empty: no chart
};

// One line of the output. `baseline` names what the engine is compared with;
// `ratio` = gbps / baseline_gbps (0 when there is no baseline).
struct BenchRow {
  std::string transport, op, pattern;
  uint64_t block_bytes = 0, batch = 0;
  double gbps = 0, latency_us = 0;
  std::string baseline;
  double baseline_gbps = 0, ratio = 0;
  // tcp only: UCX over TCP (ucx_perftest ucp_get, 1 MiB) and gbps / that.
  double ucx_tcp_gbps = 0, ucx_tcp_ratio = 0;
  // Device rows: the second baseline (one cudaMemcpyAsync per descriptor)
  // and gbps / that; `baseline` is one cudaMemcpy of the same bytes.
  double per_copy_gbps = 0, per_copy_ratio = 0;
};

// Calls `once(k)` for k = 0, 1, ... until `min_seconds` passed, `reps` times;
// returns the median repetition as (seconds per call, calls per second). A
// false from `once` stops and is reported as an error by the caller.
struct Timing {
  double seconds_per_call = 0;
  bool ok = true;
};
Timing time_median(const std::function<bool(uint64_t)>& once, double min_seconds, uint32_t reps);

// The descriptors of one measurement: buffers of `buffer_bytes` cut into
// blocks; descriptor i of the run moves remote block perm[i] to local block i
// (perm is the identity for "contiguous", a fixed random permutation for
// "shuffled"). Transfer k takes the next `batch` descriptors, wrapping at the
// end of the buffer, so successive transfers walk the whole buffer instead of
// re-reading one cache-hot block. The batch is capped at the number of blocks
// so that no two descriptors of a transfer touch the same block.
class Workload {
 public:
  Workload(uint64_t buffer_bytes, uint64_t block_bytes, bool shuffled, uint64_t batch, RegionId local, RegionId remote);
  uint64_t batch() const { return batch_; }
  uint64_t block_bytes() const { return block_bytes_; }
  uint64_t bytes_per_transfer() const { return batch_ * block_bytes_; }
  std::span<const TransferItem> transfer(uint64_t k) const {
    return {items_.data() + (k * batch_) % num_blocks_, batch_};
  }

 private:
  uint64_t block_bytes_, num_blocks_, batch_;
  std::vector<TransferItem> items_;  // num_blocks_ + batch_ entries: a window never wraps
};

// Measures every (block, pattern, batch, op) of one transport with `engine`
// (cmd_bench.cc); `second` is a second baseline per row (device rows), or
// empty.
struct Baseline {
  std::string name;
  std::function<bool(const Workload&, bool read, uint64_t k)> once;
  std::function<double(const Workload&, bool read)> fixed_gbps;
  // The row's baseline name when it depends on the row (else `name`).
  std::function<std::string(const Workload&, bool read)> row_name;
};
Status measure(const std::string& transport, const BenchArgs& args, Engine& engine, PeerId peer, RegionId local_region,
               RegionId remote_region, const Baseline& baseline, std::vector<BenchRow>& rows,
               const Baseline* second = nullptr);

// The cuda_ipc rows (bench_device.cc): kUnavailable saying why when the
// process has no device.
Status bench_device(const BenchArgs& args, std::vector<BenchRow>& rows);
// What the device rows ran on ("CUDA device 0 of 2", or the host fake).
std::string device_description();

inline double gbps(uint64_t bytes, double seconds) { return seconds > 0 ? bytes * 8.0 / seconds / 1e9 : 0; }

}  // namespace kvbridge::cli::bench

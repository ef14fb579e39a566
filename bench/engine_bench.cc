// The CPU cost of posting descriptors in Engine::submit(): a prepared list
// (items checked and resolved once, posted by index) against items checked
// on every submit, for batches of 100 to 100,000 descriptors of 256 bytes
// shuffled on the remote side (so nothing merges). Only submit() is timed:
// the transfers run on the engine's workers outside the timed region.
//
// Counters (run with --benchmark_counters_tabular=true):
//   ns_per_descriptor  CPU time of the submitting thread in submit() per
//                      descriptor (CLOCK_THREAD_CPUTIME_ID; target: <= 50
//                      for a prepared list)
//   descriptors_per_s  descriptors posted per second of that CPU time
// BM_VerifyContent: what the end-to-end content check costs a read.
#include <benchmark/benchmark.h>

#include <time.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvbridge/engine.h"

namespace kvbridge {
namespace {

constexpr uint64_t kBlock = 256;

struct Setup {
  explicit Setup(size_t n) : x(n * kBlock), y(n * kBlock) {
    EngineOptions o;
    o.transports = {"local"};
    o.inline_bytes = 0;  // submit only posts; workers copy
    o.name = "bench-a";
    a = std::move(*Engine::create(o));
    o.name = "bench-b";
    b = std::move(*Engine::create(o));
    const RegionId rx = *a->register_memory(x.data(), x.size());
    const RegionId ry = *b->register_memory(y.data(), y.size());
    peer = *a->connect(b->metadata());
    std::vector<uint64_t> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    for (size_t i = 0; i < n; ++i) items.push_back({rx, i * kBlock, ry, perm[i] * kBlock, kBlock});
    selection.resize(n);
    std::iota(selection.begin(), selection.end(), 0);
  }
  std::vector<uint8_t> x, y;
  std::unique_ptr<Engine> a, b;
  PeerId peer = 0;
  std::vector<TransferItem> items;
  std::vector<uint32_t> selection;
};

double thread_cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

// Times one submit on this thread's CPU clock; waits for the transfer
// outside the timed region.
template <typename Submit>
bool timed_submit(benchmark::State& state, Engine& e, double* cpu_ns, Submit submit) {
  const double t0 = thread_cpu_ns();
  Result<TransferId> id = submit();
  *cpu_ns += thread_cpu_ns() - t0;
  if (!id.ok()) {
    state.SkipWithError(id.error().to_string().c_str());
    return false;
  }
  state.PauseTiming();
  (void)e.wait(*id, std::chrono::seconds(30));
  (void)e.release(*id);
  state.ResumeTiming();
  return true;
}

void counters(benchmark::State& state, size_t n, double cpu_ns) {
  const double descriptors = static_cast<double>(state.iterations()) * static_cast<double>(n);
  state.counters["ns_per_descriptor"] = cpu_ns / descriptors;
  state.counters["descriptors_per_s"] = descriptors / (cpu_ns * 1e-9);
}

void BM_SubmitPrepared(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  Setup s(n);
  const PreparedId list = *s.a->prepare(s.peer, TransferOp::kRead, s.items);
  double cpu_ns = 0;
  for (auto _ : state) {
    if (!timed_submit(state, *s.a, &cpu_ns, [&] { return s.a->submit(list, s.selection, SubmitOptions{}); })) return;
  }
  counters(state, n, cpu_ns);
}

void BM_SubmitItems(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  Setup s(n);
  double cpu_ns = 0;
  for (auto _ : state) {
    if (!timed_submit(state, *s.a, &cpu_ns, [&] { return s.a->submit(s.peer, TransferOp::kRead, s.items); })) return;
  }
  counters(state, n, cpu_ns);
}

BENCHMARK(BM_SubmitPrepared)->Arg(100)->Arg(10000)->Arg(100000);
BENCHMARK(BM_SubmitItems)->Arg(100)->Arg(10000)->Arg(100000);

// A layer-major read (80 layers, a region each on both sides, 1,250
// shuffled blocks of 256 bytes per layer: 100,000 descriptors) submitted
// three ways: every item (BM_SubmitLayers/0), the first layer's items and
// 79 moved runs (/1), the first layer's items and one run naming a table
// of the 79 moves prepared once (/2, Engine::prepare_moves). The second
// argument is the blocks per layer: 128 is one stage of a chunked load
// (2,048 tokens), where what a submit costs whatever its size shows. Only
// the submitting thread's CPU counts; ns_per_descriptor is per descriptor
// of the whole read, us_per_submit per call.
void BM_SubmitLayers(benchmark::State& state) {
  constexpr size_t kLayers = 80;
  const int64_t how = state.range(0);
  const size_t kBlocks = static_cast<size_t>(state.range(1));
  std::vector<uint8_t> x(kLayers * kBlocks * kBlock), y(x.size());
  EngineOptions o;
  o.transports = {"local"};
  o.inline_bytes = 0;
  o.name = "layers-a";
  std::unique_ptr<Engine> a = std::move(*Engine::create(o));
  o.name = "layers-b";
  std::unique_ptr<Engine> b = std::move(*Engine::create(o));
  std::vector<RegionId> rx, ry;
  for (size_t l = 0; l < kLayers; ++l) {
    rx.push_back(*a->register_memory(x.data() + l * kBlocks * kBlock, kBlocks * kBlock));
    ry.push_back(*b->register_memory(y.data() + l * kBlocks * kBlock, kBlocks * kBlock));
  }
  const PeerId peer = *a->connect(b->metadata());
  std::vector<uint64_t> perm(kBlocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  std::vector<TransferItem> items;
  std::vector<ItemRun> runs = {{0, kBlocks}};
  std::vector<RunMove> moves;
  for (size_t l = 0; l < (how == 0 ? kLayers : 1); ++l) {
    for (size_t i = 0; i < kBlocks; ++i) items.push_back({rx[l], i * kBlock, ry[l], perm[i] * kBlock, kBlock});
  }
  for (size_t l = 1; l < kLayers; ++l) {
    runs.push_back({0, kBlocks, true, rx[l], 0, ry[l], 0});
    moves.push_back({rx[l], 0, ry[l], 0});
  }
  if (how == 2) {
    ItemRun table{0, kBlocks, true};
    table.moves = *a->prepare_moves(peer, TransferOp::kRead, moves);
    runs = {{0, kBlocks}, table};
  }
  double cpu_ns = 0;
  for (auto _ : state) {
    if (!timed_submit(state, *a, &cpu_ns, [&] {
          return how == 0 ? a->submit(peer, TransferOp::kRead, items)
                          : a->submit(peer, TransferOp::kRead, items, runs, SubmitOptions{});
        })) {
      return;
    }
  }
  counters(state, kLayers * kBlocks, cpu_ns);
  state.counters["us_per_submit"] = 1e-3 * cpu_ns / static_cast<double>(state.iterations());
}
BENCHMARK(BM_SubmitLayers)->ArgsProduct({{0, 1, 2}, {1250}})->Args({2, 128});

double wall_s() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The content check's cost (SubmitOptions::verify_content): one read of
// 64 MiB in 4096 shuffled descriptors of 16 KiB, without and with the check,
// over local (read back into scratch memory and hashed) and tcp on loopback
// (the peer's server hashes its own bytes), against a memcpy of the same
// bytes in the same run. Counters: GBps of each, and check_cost, the checked
// transfer's time over the plain one's.
void BM_VerifyContent(benchmark::State& state) {
  constexpr uint64_t kPiece = 16 << 10, kCount = 4096, kBytes = kPiece * kCount;
  const bool tcp = state.range(0) == 1;
  std::vector<uint8_t> x(kBytes), y(kBytes);
  for (uint64_t i = 0; i < kBytes; ++i) y[i] = static_cast<uint8_t>(i * 31 + 7);
  EngineOptions o;
  o.transports = {tcp ? "tcp" : "local"};
  o.name = "verify-a";
  std::unique_ptr<Engine> a = std::move(*Engine::create(o));
  o.name = "verify-b";
  std::unique_ptr<Engine> b = std::move(*Engine::create(o));
  const RegionId rx = *a->register_memory(x.data(), x.size());
  const RegionId ry = *b->register_memory(y.data(), y.size());
  const PeerId peer = *a->connect(b->metadata());
  std::vector<uint64_t> perm(kCount);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  std::vector<TransferItem> items;
  for (uint64_t i = 0; i < kCount; ++i) items.push_back({rx, i * kPiece, ry, perm[i] * kPiece, kPiece});
  double plain = 0, checked = 0, copy = 0;
  auto run = [&](bool verify) {
    SubmitOptions so;
    so.verify_content = verify;
    const double t0 = wall_s();
    Result<TransferId> id = a->submit(peer, TransferOp::kRead, items, std::move(so));
    if (!id.ok()) return -1.0;
    const TransferStatus st = a->wait(*id, std::chrono::seconds(60));
    (void)a->release(*id);
    return st.state == TransferState::kDone ? wall_s() - t0 : -1.0;
  };
  for (auto _ : state) {
    const double p = run(false), c = run(true);
    if (p < 0 || c < 0) {
      state.SkipWithError("a transfer failed");
      return;
    }
    plain += p;
    checked += c;
    const double t0 = wall_s();
    std::memcpy(x.data(), y.data(), kBytes);
    benchmark::ClobberMemory();
    copy += wall_s() - t0;
  }
  const double n = static_cast<double>(state.iterations()), gb = static_cast<double>(kBytes) * 1e-9;
  state.counters["plain_GBps"] = gb * n / plain;
  state.counters["checked_GBps"] = gb * n / checked;
  state.counters["memcpy_GBps"] = gb * n / copy;
  state.counters["check_cost"] = checked / plain;
}
BENCHMARK(BM_VerifyContent)->ArgName("tcp")->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvbridge

BENCHMARK_MAIN();

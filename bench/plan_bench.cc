// Planning cost of a 128k-token request, against the cost of copying the same
// bytes with memcpy on this machine, and the descriptor counts against the
// usual one-per-(layer, block) scheme.
//
// Counters (per benchmark; run with --benchmark_counters_tabular=true):
//   descriptors    descriptors in the plan
//   bytes          bytes the plan moves into the local rank
//   plan_ms        mean wall time of one plan() call
//   memcpy_ms      one memcpy of `bytes` (through two buffers of at most 1
//                  GiB, chunk by chunk), best of two, measured in this run
//   plan_pct       plan_ms / memcpy_ms in percent (target: <= 2)
//   B_per_desc     bytes of plan memory per descriptor (capacity * 32 / size)
//   naive          naive_descriptor_count(): one per (layer, component, block
//                  pair, source rank)
//   naive_x        naive / descriptors
//   layer_blocks   one per (layer, moving local block): what a per-(layer,
//                  block) scheme posts; layer_blocks_x = layer_blocks / descriptors
//
// BM_Instantiate rows, after the BM_Plan rows with the same scenarios,
// instantiate a plan template (plan.h) of the scenario's request shape with
// its ids:
//   instantiate_ms  mean wall time of one instantiate(request, &plan) into a
//                   Plan reused across calls
//   instantiate_pct instantiate_ms / memcpy_ms in percent (target: <= 0.5)
//   fresh_ms        one instantiate(request) into a new Plan (its memory
//                   faulted in on the way)
//   plan_ms         one plan() of the same request, for comparison
//   create_ms       PlanTemplate::create() of the shape, once
//   pieces          pieces the template holds
//
// BM_Stages rows plan a load as the connector does, cut into stages
// (plan_stages(): one stage for a whole load, one per layer streamed),
// afresh and from a stage template (StageTemplate, plan.h), the template a
// decode rank keeps per (remote instance, request shape):
//   stages          stages of the load
//   plan_stages_ms  mean wall time of one plan_stages()
//   instantiate_ms  mean wall time of one StageTemplate::instantiate()
//   speedup_x       plan_stages_ms / instantiate_ms
//   create_ms       StageTemplate::create() of the shape, once
//   memcpy_ms       one memcpy of the load's bytes, measured in this run
//   instantiate_pct instantiate_ms / memcpy_ms in percent
//   hbm_pct         instantiate_ms against the load's bytes at 1.5 TB/s (a
//                   GPU's copy rate, computed, not measured), in percent
//   compact_ms      mean wall time of one StageTemplate::instantiate_compact()
//                   (what the connector takes: later layers as moved runs)
//   compact_literal, compact_runs  the literal descriptors and the runs it holds
//   moved_ms        mean wall time of one StageTemplate::instantiate_moved()
//                   (a streamed load's: later layers' stages as the first
//                   layer's moved); moved_stages, moved_literal: the stages
//                   it gives so, and the literal descriptors it holds
//   compact_hbm_pct compact_ms against the bytes at 1.5 TB/s, in percent
// The chunks_2048 rows cut as the connector cuts a load that is not
// streamed (load_chunk_tokens 2048).
//
// Scenarios (decode pulls; local = decode rank 0, remotes = every prefill
// rank); the TP sizes, orders and block ids are in each name.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/content.h"
#include "kvbridge/layout.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "plan/random_request.h"

namespace kvbridge {
namespace {

namespace gen = ::kvbridge::testing;

constexpr uint64_t kTokens = 128 * 1024;
constexpr uint64_t kMaxBuffer = uint64_t{1} << 30;

struct Scenario {
  std::string preset;
  uint32_t prefill_tp;
  uint32_t decode_tp;
  Order prefill_order;
  Order decode_order;
  uint64_t block_tokens;  // 0: the preset's default
  gen::BlockIds ids;
  uint32_t prefill_pp = 1;  // pipeline stages of the prefill instance
  uint32_t decode_dcp = 1;  // context shards of the decode instance (--dcp)
  uint64_t dcp_interleave = 1;
};

std::vector<Layout> instance(const Scenario& s, uint32_t tp, Order order, uint64_t num_blocks, uint32_t pp = 1,
                             uint32_t dcp = 1) {
  std::vector<Layout> ranks;
  for (uint32_t stage = 0; stage < pp; ++stage) {
    for (uint32_t r = 0; r < tp; ++r) {
      Result<Layout> l = make_preset(PresetOptions{.name = s.preset,
                                                   .tp_size = tp,
                                                   .tp_rank = r,
                                                   .block_tokens = s.block_tokens,
                                                   .order = order,
                                                   .num_blocks = num_blocks,
                                                   .pp_size = pp,
                                                   .pp_rank = stage,
                                                   .dcp_size = dcp,
                                                   .dcp_interleave = s.dcp_interleave});
      if (!l) {
        std::fprintf(stderr, "plan_bench: %s\n", l.error().to_string().c_str());
        std::exit(1);
      }
      ranks.push_back(std::move(*l));
    }
  }
  return ranks;
}

// Enough blocks for kTokens in every group, overlaid groups included.
uint64_t num_blocks_for(const Scenario& s) {
  Result<Layout> probe = make_preset(PresetOptions{.name = s.preset, .block_tokens = s.block_tokens, .num_blocks = 1});
  uint64_t need = 64;
  if (probe) {
    for (const Group& g : probe->groups) {
      need += g.kind == GroupKind::kState ? gen::kMaxStateBlocks : gen::token_list_length(g.block_tokens, kTokens);
    }
  }
  return need;
}

// (layer, block) pairs with moving positions in the local rank: what a
// per-(layer, block) scheme posts at the least.
uint64_t layer_blocks(const Layout& local, const Request& request) {
  uint64_t n = 0;
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    uint64_t blocks = 1;
    if (g.kind == GroupKind::kAttention || g.kind == GroupKind::kSlidingWindow) {
      const gen::PositionRange r = gen::moving_positions(g, request.num_tokens, request.skip_tokens);
      const uint64_t per = g.positions_per_block();
      blocks = r.count() == 0 ? 0 : (r.end - 1) / per - r.first / per + 1;
    }
    n += blocks * g.layers.size();
  }
  return n;
}

// Two pre-faulted buffers of up to kMaxBuffer bytes, shared by every benchmark.
struct Buffers {
  std::unique_ptr<char[]> src, dst;
  uint64_t size = 0;
};
Buffers& buffers(uint64_t want) {
  static Buffers b;
  want = std::min(want, kMaxBuffer);
  if (b.size < want) {
    b.src.reset();
    b.dst.reset();
    b.src.reset(new char[want]);
    b.dst.reset(new char[want]);
    std::memset(b.src.get(), 0x5a, want);
    std::memset(b.dst.get(), 0, want);
    b.size = want;
  }
  return b;
}

// Seconds to memcpy `bytes` chunk by chunk, best of two passes. Measured
// once per size in a run, so a scenario's plan() and template rows share it.
double memcpy_seconds(uint64_t bytes) {
  if (bytes == 0) return 0;
  static std::map<uint64_t, double> measured;
  if (auto it = measured.find(bytes); it != measured.end()) return it->second;
  Buffers& b = buffers(bytes);
  double best = 1e30;
  for (int pass = 0; pass < 2; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t done = 0; done < bytes;) {
      const uint64_t n = std::min(b.size, bytes - done);
      std::memcpy(b.dst.get(), b.src.get(), n);
      benchmark::ClobberMemory();
      done += n;
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  measured[bytes] = best;
  return best;
}

// A scenario's layouts and request.
struct Inputs {
  std::vector<Layout> prefill, decode;
  Request request;
  const Layout& local() const { return decode.front(); }
};
Inputs inputs(const Scenario& s) {
  Inputs in;
  const uint64_t num_blocks = num_blocks_for(s);
  in.prefill = instance(s, s.prefill_tp, s.prefill_order, num_blocks, s.prefill_pp);
  in.decode = instance(s, s.decode_tp, s.decode_order, num_blocks, 1, s.decode_dcp);
  gen::Rng rng(0x6b76627269646765ULL);
  gen::RequestOptions o;
  o.num_tokens = kTokens;
  o.local_ids = o.remote_ids = s.ids;
  o.local_unused_as_minus_one_percent = o.remote_unused_as_minus_one_percent = 0;
  in.request = gen::make_request(rng, in.local(), in.prefill, o);
  return in;
}

void BM_Plan(benchmark::State& state, Scenario s) {
  const Inputs in = inputs(s);
  const Layout& local = in.local();
  const std::vector<Layout>& prefill = in.prefill;
  const Request& request = in.request;

  Result<Plan> first = plan(local, prefill, request);
  if (!first) {
    state.SkipWithError(first.error().to_string().c_str());
    return;
  }
  double plan_seconds = 0;
  uint64_t calls = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    Result<Plan> p = plan(local, prefill, request);
    plan_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++calls;
    benchmark::DoNotOptimize(p);
  }
  const Plan& p = *first;
  const double plan_ms = 1e3 * plan_seconds / static_cast<double>(std::max<uint64_t>(calls, 1));
  const double memcpy_ms = 1e3 * memcpy_seconds(p.bytes);
  const double descriptors = static_cast<double>(p.descriptors.size());
  const double naive = static_cast<double>(naive_descriptor_count(local, prefill, request));
  const double pairs = static_cast<double>(layer_blocks(local, request));
  state.counters["descriptors"] = descriptors;
  state.counters["bytes"] = static_cast<double>(p.bytes);
  state.counters["plan_ms"] = plan_ms;
  state.counters["memcpy_ms"] = memcpy_ms;
  state.counters["plan_pct"] = memcpy_ms > 0 ? 100.0 * plan_ms / memcpy_ms : 0;
  state.counters["B_per_desc"] =
      descriptors > 0 ? static_cast<double>(p.descriptors.capacity() * sizeof(Descriptor)) / descriptors : 0;
  state.counters["naive"] = naive;
  state.counters["naive_x"] = descriptors > 0 ? naive / descriptors : 0;
  state.counters["layer_blocks"] = pairs;
  state.counters["layer_blocks_x"] = descriptors > 0 ? pairs / descriptors : 0;
}

// Instantiating a template of the request's shape with the request's ids,
// into one Plan reused across iterations (as an engine reuses its plan
// buffer), against plan() and memcpy of the same request.
void BM_Instantiate(benchmark::State& state, Scenario s) {
  const Inputs in = inputs(s);
  const auto c0 = std::chrono::steady_clock::now();
  Result<PlanTemplate> t = PlanTemplate::create(in.local(), in.prefill, shape_of(in.request));
  const double create_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
  if (!t) {
    state.SkipWithError(t.error().to_string().c_str());
    return;
  }
  Plan p;
  if (Status first = t->instantiate(in.request, &p); !first.ok()) {
    state.SkipWithError(first.to_string().c_str());
    return;
  }
  double seconds = 0;
  uint64_t calls = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    Status st = t->instantiate(in.request, &p);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++calls;
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(p.descriptors.data());
  }
  // One instantiation into a fresh Plan (its pages faulted in), and one plan().
  const auto f0 = std::chrono::steady_clock::now();
  Result<Plan> fresh = t->instantiate(in.request);
  const auto f1 = std::chrono::steady_clock::now();
  Result<Plan> planned = plan(in.local(), in.prefill, in.request);
  const auto f2 = std::chrono::steady_clock::now();
  benchmark::DoNotOptimize(fresh);
  if (!planned || planned->descriptors != p.descriptors) {
    state.SkipWithError("the instance differs from plan()");
    return;
  }
  const double ms = 1e3 * seconds / static_cast<double>(std::max<uint64_t>(calls, 1));
  const double memcpy_ms = 1e3 * memcpy_seconds(p.bytes);
  state.counters["descriptors"] = static_cast<double>(p.descriptors.size());
  state.counters["bytes"] = static_cast<double>(p.bytes);
  state.counters["pieces"] = static_cast<double>(t->pieces());
  state.counters["create_ms"] = 1e3 * create_seconds;
  state.counters["instantiate_ms"] = ms;
  state.counters["fresh_ms"] = 1e3 * std::chrono::duration<double>(f1 - f0).count();
  state.counters["plan_ms"] = 1e3 * std::chrono::duration<double>(f2 - f1).count();
  state.counters["memcpy_ms"] = memcpy_ms;
  state.counters["instantiate_pct"] = memcpy_ms > 0 ? 100.0 * ms / memcpy_ms : 0;
}

// A load planned into stages afresh and from its stage template.
void BM_Stages(benchmark::State& state, Scenario s, uint32_t layers_per_stage, uint64_t chunk_tokens = 0) {
  const Inputs in = inputs(s);
  const StageOptions o{layers_per_stage, chunk_tokens};
  const auto c0 = std::chrono::steady_clock::now();
  Result<StageTemplate> t = StageTemplate::create(in.local(), in.prefill, shape_of(in.request), o);
  const double create_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
  if (!t) {
    state.SkipWithError(t.error().to_string().c_str());
    return;
  }
  double seconds = 0;
  uint64_t calls = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    Result<std::vector<PlanStage>> st = t->instantiate(in.request);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++calls;
    benchmark::DoNotOptimize(st);
  }
  // plan_stages() a few times, and the instance checked against it.
  double planned_seconds = 0;
  Result<std::vector<PlanStage>> planned = Status::internal("not planned");
  for (int i = 0; i < 3; ++i) {
    const auto p0 = std::chrono::steady_clock::now();
    planned = plan_stages(in.local(), in.prefill, in.request, o);
    planned_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
  }
  Result<std::vector<PlanStage>> instance = t->instantiate(in.request);
  if (!planned || !instance || planned->size() != instance->size()) {
    state.SkipWithError("the instance differs from plan_stages()");
    return;
  }
  // The compact stages the connector takes, timed the same way.
  Result<std::vector<CompactStage>> compact = t->instantiate_compact(in.request);
  double compact_seconds = 0;
  uint64_t compact_calls = 0, literal = 0, runs = 0;
  for (; compact_calls < std::max<uint64_t>(calls, 3); ++compact_calls) {
    const auto c1 = std::chrono::steady_clock::now();
    compact = t->instantiate_compact(in.request);
    compact_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - c1).count();
  }
  if (!compact || compact->size() != planned->size()) {
    state.SkipWithError("the compact instance differs from plan_stages()");
    return;
  }
  // The same with later layers' stages as their first layer's moved (what
  // the connector takes for a streamed load).
  Result<std::vector<CompactStage>> moved = t->instantiate_moved(in.request);
  double moved_seconds = 0;
  uint64_t moved_calls = 0, moved_stages = 0, moved_literal = 0;
  for (; moved_calls < std::max<uint64_t>(calls, 3); ++moved_calls) {
    const auto c1 = std::chrono::steady_clock::now();
    moved = t->instantiate_moved(in.request);
    moved_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - c1).count();
  }
  if (!moved || moved->size() != planned->size()) {
    state.SkipWithError("the moved instance differs from plan_stages()");
    return;
  }
  for (size_t k = 0; k < moved->size(); ++k) {
    if (expand(*moved, k).descriptors != (*planned)[k].plan.descriptors) {
      state.SkipWithError("a moved stage differs from plan_stages()");
      return;
    }
    moved_stages += (*moved)[k].moved_from >= 0;
    moved_literal += (*moved)[k].plan.literal.size();
  }
  uint64_t bytes = 0, descriptors = 0;
  for (size_t k = 0; k < planned->size(); ++k) {
    if ((*planned)[k].plan.descriptors != (*instance)[k].plan.descriptors ||
        expand((*compact)[k].plan).descriptors != (*planned)[k].plan.descriptors) {
      state.SkipWithError("the instance differs from plan_stages()");
      return;
    }
    literal += (*compact)[k].plan.literal.size();
    runs += (*compact)[k].plan.runs.size();
    bytes += (*planned)[k].plan.bytes;
    descriptors += (*planned)[k].plan.descriptors.size();
  }
  const double ms = 1e3 * seconds / static_cast<double>(std::max<uint64_t>(calls, 1));
  const double plan_ms = 1e3 * planned_seconds / 3;
  const double memcpy_ms = 1e3 * memcpy_seconds(bytes);
  const double hbm_ms = 1e3 * static_cast<double>(bytes) / 1.5e12;
  state.counters["stages"] = static_cast<double>(planned->size());
  state.counters["descriptors"] = static_cast<double>(descriptors);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["create_ms"] = 1e3 * create_seconds;
  state.counters["plan_stages_ms"] = plan_ms;
  state.counters["instantiate_ms"] = ms;
  state.counters["speedup_x"] = ms > 0 ? plan_ms / ms : 0;
  const double compact_ms = 1e3 * compact_seconds / static_cast<double>(compact_calls);
  state.counters["compact_ms"] = compact_ms;
  state.counters["compact_literal"] = static_cast<double>(literal);
  state.counters["compact_runs"] = static_cast<double>(runs);
  state.counters["compact_hbm_pct"] = hbm_ms > 0 ? 100.0 * compact_ms / hbm_ms : 0;
  state.counters["moved_ms"] = 1e3 * moved_seconds / static_cast<double>(moved_calls);
  state.counters["moved_stages"] = static_cast<double>(moved_stages);
  state.counters["moved_literal"] = static_cast<double>(moved_literal);
  state.counters["memcpy_ms"] = memcpy_ms;
  state.counters["instantiate_pct"] = memcpy_ms > 0 ? 100.0 * ms / memcpy_ms : 0;
  state.counters["hbm_pct"] = hbm_ms > 0 ? 100.0 * ms / hbm_ms : 0;
}

// Writing and checking a request's deterministic content (content.h), what
// the demo's prefill ranks do for every layer and its decode ranks for every
// load, against memcpy of the same bytes:
//   fill_ms, check_ms   one fill_request() / check_request() of the request
//   fill_x, check_x     memcpy_ms / fill_ms (1.0: as fast as memcpy)
void BM_Content(benchmark::State& state, std::string preset, uint64_t tokens, Order order) {
  Result<Layout> layout = make_preset(PresetOptions{.name = preset, .order = order, .num_blocks = 8 + tokens / 16});
  if (!layout) {
    state.SkipWithError(layout.error().to_string().c_str());
    return;
  }
  std::vector<std::vector<uint8_t>> memory;
  std::vector<std::span<uint8_t>> spans;
  for (const Tensor& t : layout->tensors) memory.emplace_back(t.bytes, 0);
  for (auto& m : memory) spans.emplace_back(m);
  gen::Rng rng(7);
  gen::RequestOptions o;
  o.num_tokens = tokens;
  const std::vector<Layout> remotes{*layout};
  Request request = gen::make_request(rng, *layout, remotes, o);
  double fill_s = 0, check_s = 0;
  uint64_t calls = 0, bytes = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    Status f = fill_request(*layout, request, RequestSide::kLocal, 0, 3, spans);
    const auto t1 = std::chrono::steady_clock::now();
    Result<ContentReport> c = check_request(*layout, request, RequestSide::kLocal, 0, 3, spans);
    const auto t2 = std::chrono::steady_clock::now();
    if (!f.ok() || !c || c->bad_cells != 0) {
      state.SkipWithError("fill or check failed");
      return;
    }
    bytes = c->bytes;
    fill_s += std::chrono::duration<double>(t1 - t0).count();
    check_s += std::chrono::duration<double>(t2 - t1).count();
    ++calls;
  }
  const double n = static_cast<double>(std::max<uint64_t>(calls, 1));
  const double memcpy_ms = 1e3 * memcpy_seconds(bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["fill_ms"] = 1e3 * fill_s / n;
  state.counters["check_ms"] = 1e3 * check_s / n;
  state.counters["memcpy_ms"] = memcpy_ms;
  state.counters["fill_x"] = fill_s > 0 ? memcpy_ms / (1e3 * fill_s / n) : 0;
  state.counters["check_x"] = check_s > 0 ? memcpy_ms / (1e3 * check_s / n) : 0;
}

constexpr auto kL = Order::kLBHNC;
constexpr auto kN = Order::kLBNHC;
constexpr auto kB = Order::kBLHNC;
constexpr auto kSeq = gen::BlockIds::kConsecutive;
constexpr auto kShuf = gen::BlockIds::kShuffled;

// The first argument is the benchmark's name, as written.
// clang-format off
BENCHMARK_CAPTURE(BM_Plan, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/consecutive,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/shuffled,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, llama3_70b/P_TP8_BLHNC/D_TP8_BLHNC/b16/consecutive,
                  Scenario{"llama3-70b", 8, 8, kB, kB, 16, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, llama3_70b/P_TP8_BLHNC/D_TP8_BLHNC/b16/shuffled,
                  Scenario{"llama3-70b", 8, 8, kB, kB, 16, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, llama3_70b/P_TP8_LBHNC/D_TP2_LBHNC/b16/shuffled,
                  Scenario{"llama3-70b", 8, 2, kL, kL, 16, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, llama3_70b/P_PP2xTP4_LBHNC/D_TP8_LBHNC/b16/shuffled,
                  Scenario{"llama3-70b", 4, 8, kL, kL, 16, kShuf, 2})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, deepseek_v3/P_TP8_LBHNC/D_TP8_LBHNC/b64/consecutive,
                  Scenario{"deepseek-v3", 8, 8, kL, kL, 64, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, deepseek_v3/P_TP8_LBHNC/D_TP8_LBHNC/b64/shuffled,
                  Scenario{"deepseek-v3", 8, 8, kL, kL, 64, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, deepseek_v3/P_TP8_LBHNC/D_TP8_DCP2_LBHNC/b64/consecutive,
                  Scenario{"deepseek-v3", 8, 8, kL, kL, 64, kSeq, 1, 2, 64})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, glm5_flash/P_TP4_LBHNC/D_TP4_LBHNC/b2304/consecutive,
                  Scenario{"glm5-flash", 4, 4, kL, kL, 0, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, glm5_flash/P_TP4_BLHNC/D_TP4_BLHNC/b2304/shuffled,
                  Scenario{"glm5-flash", 4, 4, kB, kB, 0, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, qwen3_next/P_TP4_LBNHC/D_TP2_LBNHC/b64/consecutive,
                  Scenario{"qwen3-next", 4, 2, kN, kN, 64, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Plan, qwen3_next/P_TP4_LBNHC/D_TP2_LBNHC/b64/shuffled,
                  Scenario{"qwen3-next", 4, 2, kN, kN, 64, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/consecutive,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/shuffled,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, llama3_70b/P_TP8_BLHNC/D_TP8_BLHNC/b16/consecutive,
                  Scenario{"llama3-70b", 8, 8, kB, kB, 16, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, llama3_70b/P_TP8_BLHNC/D_TP8_BLHNC/b16/shuffled,
                  Scenario{"llama3-70b", 8, 8, kB, kB, 16, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, llama3_70b/P_TP8_LBHNC/D_TP2_LBHNC/b16/shuffled,
                  Scenario{"llama3-70b", 8, 2, kL, kL, 16, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, llama3_70b/P_PP2xTP4_LBHNC/D_TP8_LBHNC/b16/shuffled,
                  Scenario{"llama3-70b", 4, 8, kL, kL, 16, kShuf, 2})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, deepseek_v3/P_TP8_LBHNC/D_TP8_LBHNC/b64/consecutive,
                  Scenario{"deepseek-v3", 8, 8, kL, kL, 64, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, deepseek_v3/P_TP8_LBHNC/D_TP8_LBHNC/b64/shuffled,
                  Scenario{"deepseek-v3", 8, 8, kL, kL, 64, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, deepseek_v3/P_TP8_LBHNC/D_TP8_DCP2_LBHNC/b64/consecutive,
                  Scenario{"deepseek-v3", 8, 8, kL, kL, 64, kSeq, 1, 2, 64})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, glm5_flash/P_TP4_LBHNC/D_TP4_LBHNC/b2304/consecutive,
                  Scenario{"glm5-flash", 4, 4, kL, kL, 0, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, glm5_flash/P_TP4_BLHNC/D_TP4_BLHNC/b2304/shuffled,
                  Scenario{"glm5-flash", 4, 4, kB, kB, 0, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, qwen3_next/P_TP4_LBNHC/D_TP2_LBNHC/b64/consecutive,
                  Scenario{"qwen3-next", 4, 2, kN, kN, 64, kSeq})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Instantiate, qwen3_next/P_TP4_LBNHC/D_TP2_LBNHC/b64/shuffled,
                  Scenario{"qwen3-next", 4, 2, kN, kN, 64, kShuf})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Stages, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/shuffled/whole,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kShuf}, 0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Stages, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/shuffled/chunks_2048,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kShuf}, 0, 2048)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Stages, llama3_70b/P_TP8_LBHNC/D_TP8_LBHNC/b16/shuffled/per_layer,
                  Scenario{"llama3-70b", 8, 8, kL, kL, 16, kShuf}, 1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Stages, llama3_70b/P_TP8_LBHNC/D_TP2_LBHNC/b16/shuffled/whole,
                  Scenario{"llama3-70b", 8, 2, kL, kL, 16, kShuf}, 0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Stages, llama3_70b/P_TP8_LBHNC/D_TP2_LBHNC/b16/shuffled/chunks_2048,
                  Scenario{"llama3-70b", 8, 2, kL, kL, 16, kShuf}, 0, 2048)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Stages, llama3_70b/P_TP8_LBHNC/D_TP2_LBHNC/b16/shuffled/per_layer,
                  Scenario{"llama3-70b", 8, 2, kL, kL, 16, kShuf}, 1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Content, llama3_8b/TP1_LBHNC/4096_tokens, "llama3-8b", 4096, kL)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Content, llama3_8b/TP1_BLHNC/4096_tokens, "llama3-8b", 4096, kB)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Content, llama3_8b/TP1_LBNHC/4096_tokens, "llama3-8b", 4096, kN)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Content, qwen3_next/TP1_LBHNC/4096_tokens, "qwen3-next", 4096, kL)->Unit(benchmark::kMillisecond);
// clang-format on

}  // namespace
}  // namespace kvbridge

BENCHMARK_MAIN();

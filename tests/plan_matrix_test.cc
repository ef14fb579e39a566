// The preset matrix: every preset x prefill TP {1,2,4,8} x decode TP {1,2,4,8}
// x physical orders x block sizes, planned for every decode rank (decode
// pulls from all prefill ranks) and checked by the verifier; a stage
// template of one layer per stage gives plan_stages()' stages; a plan template
// of each request's shape, instantiated with random ids, must give plan()'s
// plan, which the verifier checks too.
//
// By default each (preset, TP pair) runs once, with the order pair and block
// sizes cycling so that every preset also meets every order pair and every
// block-size pairing; KVB_MATRIX_FULL=1 runs the whole cross product. Pairs a
// preset's heads cannot take (make_preset() errors) are counted and skipped; a
// preset that takes no pair fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"
#include "plan/preset_instances.h"
#include "plan/random_request.h"

namespace kvbridge {
namespace {

namespace gen = ::kvbridge::testing;

constexpr uint32_t kTpSizes[] = {1, 2, 4, 8};

struct OrderPair {
  Order prefill;
  Order decode;
};
const std::vector<OrderPair>& order_pairs() {
  static const std::vector<OrderPair> pairs = {
      {Order::kLBHNC, Order::kLBHNC}, {Order::kLBNHC, Order::kLBNHC}, {Order::kBLHNC, Order::kBLHNC},
      {Order::kLBHNC, Order::kBLHNC}, {Order::kBLHNC, Order::kLBHNC}, {Order::kLBNHC, Order::kLBHNC},
  };
  return pairs;
}

// Which side uses the preset's alternative block size.
struct BlockPair {
  bool prefill_alt;
  bool decode_alt;
};
constexpr BlockPair kBlockPairs[] = {{false, false}, {false, true}, {true, false}, {true, true}};

struct Totals {
  uint64_t plans = 0;
  uint64_t instances = 0;  // template instances checked against plan() and verified
  uint64_t chunked = 0;    // requests cut into several token-ordered chunks, verified together
  uint64_t staged = 0;     // requests cut into several stages (layer x chunk), verified together
  uint64_t combos = 0;
  uint64_t skipped = 0;
  uint64_t descriptors = 0;
  uint64_t naive = 0;
  uint64_t bytes = 0;
  uint64_t sources = 0;         // source ranks chosen, summed over plans (each checked minimal)
  uint64_t staged_combos = 0;   // combinations with an instance in pipeline stages
  uint64_t sharded_combos = 0;  // combinations with an instance in context shards
};
Totals& grand_totals() {
  static Totals t;
  return t;
}

class SummaryEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    const Totals& t = grand_totals();
    std::printf(
        "[ matrix    ] %llu plans, %llu template instances, %llu chunked and %llu staged requests verified over "
        "%llu combinations (%llu with pipeline stages, %llu with context shards, %llu TP pairs "
        "skipped); %llu descriptors (naive scheme: %llu), %llu bytes, %llu source ranks (each set the fewest)\n",
        (unsigned long long)t.plans, (unsigned long long)t.instances, (unsigned long long)t.chunked,
        (unsigned long long)t.staged, (unsigned long long)t.combos, (unsigned long long)t.staged_combos,
        (unsigned long long)t.sharded_combos, (unsigned long long)t.skipped, (unsigned long long)t.descriptors,
        (unsigned long long)t.naive, (unsigned long long)t.bytes, (unsigned long long)t.sources);
  }
};
[[maybe_unused]] ::testing::Environment* const kSummary = ::testing::AddGlobalTestEnvironment(new SummaryEnvironment);

bool full_matrix() {
  const char* v = std::getenv("KVB_MATRIX_FULL");
  return v != nullptr && *v != '\0' && *v != '0';
}

// The preset's default block size (a TP-1 rank's first group).
uint64_t default_block_tokens(const std::string& preset) {
  Result<Layout> l = make_preset(PresetOptions{.name = preset, .num_blocks = 8});
  if (!l) return 0;
  uint64_t block = 0;
  for (const Group& g : l->groups) {
    if (g.kind == GroupKind::kAttention) return g.block_tokens;
    if (block == 0) block = g.block_tokens;
  }
  return block;
}

// Another block size the preset takes at TP 1 and 8: twice the default (two
// kernel blocks per block) or, for very large blocks, half of it.
uint64_t alternative_block_tokens(const std::string& preset, uint64_t block) {
  std::vector<uint64_t> candidates = block >= 1024 ? std::vector<uint64_t>{block / 2, block * 2}
                                                   : std::vector<uint64_t>{block * 2, block / 2, block * 3};
  for (uint64_t b : candidates) {
    if (b == 0 || b == block) continue;
    bool ok = true;
    for (uint32_t tp : {1u, 8u}) {
      ok = ok && make_preset(PresetOptions{.name = preset, .tp_size = tp, .block_tokens = b, .num_blocks = 8}).ok();
    }
    if (ok) return b;
  }
  return 0;
}

struct Combo {
  uint32_t prefill_tp = 1;
  uint32_t decode_tp = 1;
  uint32_t prefill_pp = 1;  // pipeline stages of each instance
  uint32_t decode_pp = 1;
  OrderPair orders{};
  BlockPair blocks{};
  uint32_t prefill_cp = 1;  // context shards of each instance (--dcp)
  uint32_t decode_cp = 1;
  uint64_t cp_interleave = 1;
};

// Every layout of one instance (stage-major), or the first error.
Result<std::vector<Layout>> instance(const std::string& preset, uint32_t tp, uint64_t block, Order order,
                                     uint64_t num_blocks, uint32_t pp = 1, uint32_t cp = 1, uint64_t interleave = 1) {
  return testing::preset_instance(PresetOptions{.name = preset,
                                                .block_tokens = block,
                                                .order = order,
                                                .num_blocks = num_blocks,
                                                .dcp_size = cp,
                                                .dcp_interleave = interleave},
                                  tp, pp);
}

// The oracle for source choice, written apart from the planner: true when
// the remote ranks flagged in `in` hold every local head of every component
// of every transfer group of `local` (a replicated component: some flagged
// rank where it is not empty).
// With context shards, each remote shard that holds some of the local
// rank's positions counts apart (found by walking positions).
bool covers(const Layout& local, const std::vector<Layout>& remotes, const std::vector<bool>& in) {
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    const ContextShard& rcs = remotes.front().find_group(g.name)->context;
    std::set<uint32_t> shards;
    for (uint64_t p = 0; p < 4096 && shards.size() < rcs.size; ++p) {
      if (g.context.holds(p)) shards.insert(rcs.shard_of(p));
    }
    for (size_t l = 0; l < g.layers.size(); ++l) {
      for (size_t c = 0; c < g.layers[l].components.size(); ++c) {
        const Component& comp = g.layers[l].components[c];
        if (comp.empty()) continue;
        for (uint32_t h = 0; h < (comp.heads ? comp.heads->count : 1); ++h) {
          for (uint32_t shard : shards) {
            bool held = false;
            for (size_t r = 0; r < remotes.size() && !held; ++r) {
              if (!in[r]) continue;
              const Group& rg = *remotes[r].find_group(g.name);
              const Component& rc = rg.layers[l].components[c];
              held = !rc.empty() && rg.context.rank == shard &&
                     (!comp.heads || (rc.heads && comp.heads->first + h >= rc.heads->first &&
                                      comp.heads->first + h < rc.heads->first + rc.heads->count));
            }
            if (!held) return false;
          }
        }
      }
    }
  }
  return true;
}

// By brute force: whether some `k` of the remote ranks cover `local`.
bool some_cover_of_size(const Layout& local, const std::vector<Layout>& remotes, size_t k) {
  std::vector<bool> in(remotes.size(), false);
  std::fill(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(std::min(k, remotes.size())), true);
  std::sort(in.begin(), in.end());  // the first permutation
  do {
    if (covers(local, remotes, in)) return true;
  } while (std::next_permutation(in.begin(), in.end()));
  return false;
}

std::string describe(const std::string& preset, const Combo& c, uint64_t pb, uint64_t db) {
  auto pp = [](uint32_t n) { return n > 1 ? " PP" + std::to_string(n) + "x" : std::string(" "); };
  auto cp = [&](uint32_t n) {
    return n > 1 ? " CP" + std::to_string(n) + "/" + std::to_string(c.cp_interleave) : std::string();
  };
  return preset + " P" + pp(c.prefill_pp) + "TP" + std::to_string(c.prefill_tp) + cp(c.prefill_cp) + " " +
         std::string(order_name(c.orders.prefill)) + " block " + std::to_string(pb) + " -> D" + pp(c.decode_pp) + "TP" +
         std::to_string(c.decode_tp) + cp(c.decode_cp) + " " + std::string(order_name(c.orders.decode)) + " block " +
         std::to_string(db);
}

class PlanMatrixTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PlanMatrixTest, EveryTpPairOrderAndBlockSizeVerifiesOnEveryDecodeRank) {
  const std::string preset = GetParam();
  const auto start = std::chrono::steady_clock::now();
  const uint64_t base_block = default_block_tokens(preset);
  ASSERT_GT(base_block, 0u) << preset << ": make_preset fails at TP 1 with defaults";
  const uint64_t alt_block = alternative_block_tokens(preset, base_block);
  ASSERT_GT(alt_block, 0u) << preset << ": no alternative block size found";
  const uint64_t preset_index = [&] {
    const std::vector<std::string> names = preset_names();
    return static_cast<uint64_t>(std::find(names.begin(), names.end(), preset) - names.begin());
  }();

  // Per TP pair, the combinations to run: all of them (full matrix), or the
  // first of a rotation that the preset takes.
  std::vector<std::vector<Combo>> per_pair;
  uint64_t i = 0;
  for (uint32_t ptp : kTpSizes) {
    for (uint32_t dtp : kTpSizes) {
      std::vector<Combo> combos;
      const size_t num_orders = order_pairs().size();
      for (size_t k = 0; k < num_orders * std::size(kBlockPairs); ++k) {
        // Rotations by pair index, so that the first choices of the 16 pairs
        // cover every order pair and every block pairing.
        const size_t order = (i + preset_index + k) % num_orders;
        const size_t block = (i + i / 8 + k / num_orders) % std::size(kBlockPairs);
        // Every third pair with a prefill in 2 pipeline stages, and the next
        // with a decode instance in 2 (3 when the prefill is TP 1).
        const uint32_t ppp = i % 3 == 1 ? 2 : 1, dpp = i % 3 == 2 ? (ptp == 1 ? 3 : 2) : 1;
        // Every fourth pair with context shards: the decode instance in 2
        // (DCP), the prefill in 2 as well on every other of those, with
        // interleaves of 1, 2 and a whole block in turn.
        const uint32_t dcp = i % 4 == 3 && dtp % 2 == 0 ? 2 : 1;
        const uint32_t pcp = dcp > 1 && i % 8 == 7 && ptp % 2 == 0 ? 2 : 1;
        const uint64_t interleave = std::vector<uint64_t>{1, 2, 16}[(i / 4 + k) % 3];
        combos.push_back({ptp, dtp, ppp, dpp, order_pairs()[order], kBlockPairs[block], pcp, dcp, interleave});
      }
      per_pair.push_back(std::move(combos));
      ++i;
    }
  }

  Totals t;
  double plan_seconds = 0, verify_seconds = 0, template_seconds = 0;
  std::set<std::pair<Order, Order>> orders_done;
  std::set<std::pair<bool, bool>> blocks_done;
  uint64_t case_index = 0;
#ifdef KVB_PROPERTY_SANITIZED
  uint64_t pair_index = 0;
#endif
  for (const std::vector<Combo>& combos : per_pair) {
    bool pair_ran = false;
#ifdef KVB_PROPERTY_SANITIZED
    // The verifier runs ~10x slower there: half of the pairs, the other half
    // for the next preset (the release build runs every pair and checks the
    // rotation's coverage).
    if ((pair_index++ + preset_index) % 2 == 1 && !full_matrix()) continue;
#endif
    for (const Combo& c : combos) {
      if (pair_ran && !full_matrix()) break;
      const uint64_t pb = c.blocks.prefill_alt ? alt_block : base_block;
      const uint64_t db = c.blocks.decode_alt ? alt_block : base_block;
      gen::Rng rng(gen::case_seed(0x3a7, preset_index * 100000 + case_index++));
      // A few thousand tokens of which the receiver has most (a prefix hit
      // ending inside a block), so the lists are long but the bytes few. The
      // prefill side lists -1 for the blocks that move nothing: verify()
      // fills every listed remote block of every rank, so this keeps its cost
      // to the moving blocks (the property test covers real ids there).
      gen::RequestOptions o;
      o.num_tokens = gen::draw(rng, 2000, 5000);
      o.skip_tokens = o.num_tokens - gen::draw(rng, 8, 64);
      o.remote_unused_as_minus_one_percent = 100;
      const uint64_t num_blocks = 8 * (o.num_tokens / std::min(pb, db) + 1) + 64;
      const std::string what = describe(preset, c, pb, db);
      Result<std::vector<Layout>> prefill =
          instance(preset, c.prefill_tp, pb, c.orders.prefill, num_blocks, c.prefill_pp, c.prefill_cp, c.cp_interleave);
      Result<std::vector<Layout>> decode =
          instance(preset, c.decode_tp, db, c.orders.decode, num_blocks, c.decode_pp, c.decode_cp, c.cp_interleave);
      if (!prefill || !decode) {
        const Status& e = prefill ? decode.error() : prefill.error();
        ASSERT_EQ(e.code(), Code::kInvalidArgument) << what << ": " << e.to_string();
        continue;
      }
      const gen::BlockIds modes[] = {gen::BlockIds::kConsecutive, gen::BlockIds::kShuffled, gen::BlockIds::kRuns};
      o.local_ids = modes[case_index % 3];
      o.remote_ids = modes[(case_index / 3) % 3];
      const Request request = gen::make_request(rng, decode->front(), *prefill, o);
      for (const Layout& local : *decode) {
        const std::string where = what + " rank " + std::to_string(local.rank()) + " (" +
                                  std::to_string(request.num_tokens) + " tokens, skip " +
                                  std::to_string(request.skip_tokens) + ")";
        const auto t0 = std::chrono::steady_clock::now();
        Result<Plan> p = plan(local, *prefill, request);
        const auto t1 = std::chrono::steady_clock::now();
        ASSERT_TRUE(p.has_value()) << where << ": " << p.error().to_string();
        Result<VerifyReport> v = verify(*p, local, *prefill, request, /*check_minimal=*/true);
        plan_seconds += std::chrono::duration<double>(t1 - t0).count();
        verify_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        ASSERT_TRUE(v.has_value()) << where << ": " << v.error().to_string();
        ASSERT_EQ(p->bytes, gen::expected_bytes(local, request)) << where;
        // The plan reads from the chosen sources only; they cover what the
        // rank needs, and no smaller set of ranks does (brute force).
        Result<std::vector<uint32_t>> chosen = source_ranks(local, *prefill);
        ASSERT_TRUE(chosen.has_value()) << where << ": " << chosen.error().to_string();
        std::vector<bool> in(prefill->size(), false);
        for (size_t s = 0; s < prefill->size(); ++s) {
          in[s] = std::count(chosen->begin(), chosen->end(), (*prefill)[s].rank()) != 0;
          ASSERT_TRUE(in[s] || p->sources[s].bytes == 0) << where << ": reads from rank " << s << ", not chosen";
        }
        ASSERT_TRUE(covers(local, *prefill, in)) << where << ": the chosen sources miss something";
        ASSERT_FALSE(some_cover_of_size(local, *prefill, chosen->size() - 1))
            << where << ": " << chosen->size() << " sources chosen, fewer would do";
        t.sources += chosen->size();
        ASSERT_EQ(v->bytes_written, p->bytes) << where;
        // Token-ordered chunks at block granularity move the same bytes.
        // The parts' descriptors one after the other, as one plan.
        auto join = [&](const auto& parts) {
          Plan all;
          all.sources = p->sources;
          for (const auto& part : parts) {
            all.descriptors.insert(all.descriptors.end(), part.plan.descriptors.begin(), part.plan.descriptors.end());
            all.bytes += part.plan.bytes;
          }
          return all;
        };
        Result<std::vector<PlanChunk>> chunks = plan_chunks(local, *prefill, request, 1);
        ASSERT_TRUE(chunks.has_value()) << where << ": " << chunks.error().to_string();
        const Plan joined = join(*chunks);
        ASSERT_EQ(joined.bytes, p->bytes) << where << " (chunks)";
        if (chunks->size() > 1) {
          Result<VerifyReport> vc = verify(joined, local, *prefill, request, /*check_minimal=*/false);
          ASSERT_TRUE(vc.has_value()) << where << " (" << chunks->size() << " chunks): " << vc.error().to_string();
          t.chunked += 1;
        }
        // Stages of one layer per token chunk (the finest streaming cut) are
        // disjoint and together move exactly the request.
        Result<std::vector<PlanStage>> stages = plan_stages(local, *prefill, request, StageOptions{1, 1});
        ASSERT_TRUE(stages.has_value()) << where << ": " << stages.error().to_string();
        const Plan staged = join(*stages);
        ASSERT_EQ(staged.bytes, p->bytes) << where << " (stages)";
        Result<VerifyReport> vs = verify(staged, local, *prefill, request, /*check_minimal=*/false);
        ASSERT_TRUE(vs.has_value()) << where << " (" << stages->size() << " stages): " << vs.error().to_string();
        t.staged += stages->size() > 1;
        // A template of the request's shape gives plan()'s plan for the
        // request and for random ids of the same shape; the instance verifies.
        const auto t2 = std::chrono::steady_clock::now();
        Result<PlanTemplate> tmpl = PlanTemplate::create(local, *prefill, shape_of(request));
        ASSERT_TRUE(tmpl.has_value()) << where << ": " << tmpl.error().to_string();
        // Uniform, but for context-sharded groups (whose entries differ by
        // shard: the template falls back to plan()).
        const bool sharded = c.prefill_cp > 1 || c.decode_cp > 1;
        ASSERT_TRUE(tmpl->uniform() || sharded) << where << ": " << tmpl->fallback_reason();
        Result<Plan> same = tmpl->instantiate(request);
        ASSERT_TRUE(same.has_value()) << where << ": " << same.error().to_string();
        ASSERT_TRUE(same->descriptors == p->descriptors && same->bytes == p->bytes) << where;
        const Request other = gen::with_other_ids(rng, request, local, *prefill, modes[(case_index + 1) % 3]);
        Result<Plan> instance = tmpl->instantiate(other);
        Result<Plan> planned = plan(local, *prefill, other);
        ASSERT_TRUE(instance.has_value() && planned.has_value())
            << where << ": " << (instance ? planned.error() : instance.error()).to_string();
        ASSERT_EQ(instance->descriptors, planned->descriptors) << where << " (other ids)";
        for (size_t s = 0; s < planned->sources.size(); ++s) {
          ASSERT_EQ(instance->sources[s].descriptors, planned->sources[s].descriptors) << where;
          ASSERT_EQ(instance->sources[s].bytes, planned->sources[s].bytes) << where;
        }
        Result<VerifyReport> vi = verify(*instance, local, *prefill, other, /*check_minimal=*/true);
        ASSERT_TRUE(vi.has_value()) << where << " (other ids): " << vi.error().to_string();
#ifndef KVB_PROPERTY_SANITIZED
        // A stage template of one layer per stage (as a streaming load cuts)
        // gives plan_stages()' stages for the other ids: the same cuts, the
        // same descriptors. (Under the sanitizers the stage templates'
        // property test covers them: here they doubled the matrix's time.)
        const StageOptions by_layer{1, 0};
        Result<StageTemplate> st = StageTemplate::create(local, *prefill, shape_of(request), by_layer);
        ASSERT_TRUE(st.has_value()) << where << ": " << st.error().to_string();
        ASSERT_TRUE(st->uniform() || sharded) << where << ": " << st->fallback_reason();
        Result<std::vector<PlanStage>> st_instance = st->instantiate(other);
        Result<std::vector<PlanStage>> st_planned = plan_stages(local, *prefill, other, by_layer);
        ASSERT_TRUE(st_instance.has_value() && st_planned.has_value()) << where << " (stage template)";
        ASSERT_EQ(st_instance->size(), st_planned->size()) << where << " (stage template)";
        for (size_t k = 0; k < st_planned->size(); ++k) {
          const PlanStage& a = (*st_instance)[k];
          const PlanStage& b = (*st_planned)[k];
          ASSERT_TRUE(a.first_layer == b.first_layer && a.end_layer == b.end_layer && a.first_token == b.first_token &&
                      a.end_token == b.end_token && a.resume_token == b.resume_token)
              << where << " (stage template, stage " << k << ")";
          ASSERT_EQ(a.plan.descriptors, b.plan.descriptors) << where << " (stage template, stage " << k << ")";
        }
        // Its compact stages expand to the same descriptors.
        Result<std::vector<CompactStage>> st_compact = st->instantiate_compact(other);
        ASSERT_TRUE(st_compact.has_value()) << where << " (compact stages)";
        ASSERT_EQ(st_compact->size(), st_planned->size()) << where << " (compact stages)";
        for (size_t k = 0; k < st_planned->size(); ++k) {
          const CompactStage& a = (*st_compact)[k];
          ASSERT_EQ(a.first_layer, (*st_planned)[k].first_layer) << where << " (compact stage " << k << ")";
          ASSERT_EQ(expand(a.plan).descriptors, (*st_planned)[k].plan.descriptors)
              << where << " (compact stage " << k << ")";
        }
#endif
        template_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
        t.instances += 1;
        t.plans += 1;
        t.descriptors += p->descriptors.size();
        t.naive += naive_descriptor_count(local, *prefill, request);
        t.bytes += p->bytes;
      }
      t.combos += 1;
      t.staged_combos += c.prefill_pp > 1 || c.decode_pp > 1;
      t.sharded_combos += c.prefill_cp > 1 || c.decode_cp > 1;
      pair_ran = true;
      orders_done.insert({c.orders.prefill, c.orders.decode});
      blocks_done.insert({c.blocks.prefill_alt, c.blocks.decode_alt});
    }
    if (!pair_ran) ++t.skipped;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ matrix    ] %-14s blocks %llu/%llu: %llu plans, %llu instances and %llu chunked over %llu combinations, %llu "
      "TP "
      "pairs skipped, %llu descriptors (naive %llu), %llu bytes, %.2f s (plan %.2f s, verify %.2f s, "
      "templates %.2f s)\n",
      preset.c_str(), (unsigned long long)base_block, (unsigned long long)alt_block, (unsigned long long)t.plans,
      (unsigned long long)t.instances, (unsigned long long)t.chunked, (unsigned long long)t.combos,
      (unsigned long long)t.skipped, (unsigned long long)t.descriptors, (unsigned long long)t.naive,
      (unsigned long long)t.bytes, seconds, plan_seconds, verify_seconds, template_seconds);
  Totals& g = grand_totals();
  g.plans += t.plans;
  g.instances += t.instances;
  g.chunked += t.chunked;
  g.staged += t.staged;
  g.combos += t.combos;
  g.skipped += t.skipped;
  g.descriptors += t.descriptors;
  g.naive += t.naive;
  g.bytes += t.bytes;
  g.sources += t.sources;
  g.staged_combos += t.staged_combos;
  g.sharded_combos += t.sharded_combos;

  EXPECT_GT(t.combos, 0u) << preset << " supports no TP pair";
#ifndef KVB_PROPERTY_SANITIZED
  EXPECT_GT(t.staged_combos, 0u) << preset << ": no combination with pipeline stages ran";
  EXPECT_GT(t.sharded_combos, 0u) << preset << ": no combination with context shards ran";
  EXPECT_EQ(orders_done.size(), order_pairs().size()) << preset << ": not every order pair ran";
  EXPECT_EQ(blocks_done.size(), std::size(kBlockPairs)) << preset << ": not every block-size pairing ran";
#endif
}

INSTANTIATE_TEST_SUITE_P(Presets, PlanMatrixTest, ::testing::ValuesIn(preset_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name;
                           for (char ch : info.param) name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });

}  // namespace
}  // namespace kvbridge

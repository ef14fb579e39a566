// Property tests of plan() on invalid inputs: requests and remote layout sets
// broken in one way each (short list, id past num_blocks, -1 that moves,
// repeated id, unknown or missing group, duplicate or mixed ranks, uncovered
// heads, scratch lists, identity mismatches, overlay id clashes) must return
// an error of the documented code, never a plan. Cases come from
// property_support.h.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "plan/property_support.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;

// ---------------------------------------------------------------------------
// Invalid requests and mismatched layouts: an error of the documented code,
// never a plan.

// A group of `request` whose lists satisfy `pred`, chosen at random; nullptr
// if none.
template <typename P>
const Group* pick_group(gen::Rng& rng, const Layout& local, P pred) {
  std::vector<const Group*> candidates;
  for (const Group& g : local.groups) {
    if (g.transfer && pred(g)) candidates.push_back(&g);
  }
  return candidates.empty() ? nullptr : gen::pick(rng, candidates);
}

// Mutates one field of the identity. Returns what it changed, or "" when the
// chosen mutation does not apply to this recipe.
std::string mutate_identity(gen::Rng& rng, gen::ModelRecipe& m) {
  gen::GroupRecipe& g = m.groups[gen::draw(rng, 0, m.groups.size() - 1)];
  gen::ComponentRecipe& c = g.components[gen::draw(rng, 0, g.components.size() - 1)];
  switch (gen::draw(rng, 0, 10)) {
    case 0:
      m.model += "-other";
      return "model";
    case 1:
      m.dtype = m.dtype == "bf16" ? "fp8" : "bf16";
      return "dtype";
    case 2:
      c.cell_bytes = c.cell_bytes == 0 ? 4 : c.cell_bytes + 2;
      return "cell_bytes of " + c.name;
    case 3:
      c.name = "renamed";
      return "component name";
    case 4:
      c.total_heads = c.total_heads == 0 ? 1 : 0;
      return "replicated vs sharded " + c.name;
    case 5:
      if (g.kind != GroupKind::kAttention && g.kind != GroupKind::kSlidingWindow) return "";
      g.tokens_per_state *= 2;
      return "tokens_per_state of " + g.name;
    case 6:
      if (!g.window_tokens) return "";
      *g.window_tokens += 1;
      return "window_tokens of " + g.name;
    case 7:
      g.layers[0] += "-renamed";
      return "layer name";
    case 8:
      if (g.components.size() < 2) return "";
      g.components.pop_back();
      return "a component fewer";
    case 9:
      if (g.kind == GroupKind::kAttention) {
        g.kind = GroupKind::kSlidingWindow;
        g.window_tokens = 16;
      } else if (g.kind == GroupKind::kSlidingWindow) {
        g.kind = GroupKind::kAttention;
        g.window_tokens.reset();
      } else {
        return "";
      }
      return "kind of " + g.name;
    case 10:
      if (g.layers.size() < 2) return "";
      g.layers.pop_back();
      return "a layer fewer";
  }
  return "";
}

struct Expectation {
  std::string kind;  // a short category, for the summary
  std::string what;
  Code code;
  bool or_plan_that_verifies = false;
};

TEST(PlanPropertyTest, InvalidRequestsAndMismatchedLayoutsReturnErrorsNeverPlans) {
  uint64_t checked = 0, failures = 0;
  std::map<std::string, uint64_t> counts;
  for (uint64_t i : case_indices(std::max<uint64_t>(num_cases() / 2, 1))) {
    gen::Rng rng(gen::case_seed(base_seed() ^ 0xbad, i));
    Case c = make_case(base_seed(), i, rng);  // labelled with the run's seed: KVB_PROPERTY_* reruns it
    Inputs in{c.local, c.remotes, c.request};
    Expectation e;
    const unsigned which = static_cast<unsigned>(gen::draw(rng, 0, 11));
    const bool on_local = gen::chance(rng, 50);
    auto list_of = [&](const std::string& group) -> std::vector<int64_t>& {
      GroupBlocks& b = in.request.blocks.at(group);
      return on_local ? b.local : b.remote;
    };
    auto num_blocks_of = [&](const std::string& group) {
      return (on_local ? in.local : in.remotes[0]).find_group(group)->num_blocks;
    };
    // With skip_tokens == num_tokens no token or state block moves, so the
    // edits below would touch blocks that move nothing.
    const bool all_skipped = in.request.skip_tokens == in.request.num_tokens;
    if ((which == 0 || which == 1 || which == 3) && all_skipped) continue;
    if (in.remotes[0].pp_size > 1 && gen::chance(rng, 40)) {
      // Drop every rank of one pipeline stage: a layer the local rank holds
      // (in a transfer group) is then held by no given rank.
      const uint32_t stage = static_cast<uint32_t>(gen::draw(rng, 0, in.remotes[0].pp_size - 1));
      std::string layer;
      for (const Group& g : in.local.groups) {
        const Group* rg = nullptr;
        for (const Layout& r : in.remotes) {
          if (r.pp_rank == stage) rg = r.find_group(g.name);
        }
        for (size_t l = 0; g.transfer && rg != nullptr && layer.empty() && l < g.layers.size(); ++l) {
          if (g.layers[l].held && rg->layers[l].held) layer = g.layers[l].name;
        }
      }
      if (layer.empty()) continue;
      std::erase_if(in.remotes, [&](const Layout& r) { return r.pp_rank == stage; });
      if (in.remotes.empty()) continue;
      e = {"stage missing", "no remote rank of stage " + std::to_string(stage) + " (it holds '" + layer + "')",
           Code::kIncompatible};
    } else if (which == 0) {
      const Group* g = pick_group(rng, in.local, [](const Group& x) { return x.kind != GroupKind::kState; });
      if (g == nullptr) continue;
      list_of(g->name).pop_back();
      e = {"short list", "a block list of group '" + g->name + "' one entry too short", Code::kInvalidArgument};
    } else if (which == 1) {
      // The last entry always moves: the final token, state or scratch block.
      const Group* g = pick_group(rng, in.local, [](const Group&) { return true; });
      list_of(g->name).back() = static_cast<int64_t>(num_blocks_of(g->name));
      e = {"id == num_blocks", "the block id of the last entry of group '" + g->name + "' == num_blocks",
           Code::kOutOfRange};
    } else if (which == 2) {
      // Any entry, moving or not: plan.h rejects every id past num_blocks.
      const Group* g = pick_group(rng, in.local, [](const Group&) { return true; });
      std::vector<int64_t>& ids = list_of(g->name);
      ids[gen::draw(rng, 0, ids.size() - 1)] = static_cast<int64_t>(num_blocks_of(g->name) + gen::draw(rng, 0, 1000));
      e = {"id > num_blocks", "a block id of group '" + g->name + "' at or past num_blocks", Code::kOutOfRange};
    } else if (which == 3) {
      // (A context shard other than 0 may not use the shared list's last
      // entry: such groups are left out.)
      const Group* g = pick_group(rng, in.local, [&](const Group& x) {
        return !x.context.sharded() && !in.remotes.front().find_group(x.name)->context.sharded();
      });
      if (g == nullptr) continue;
      list_of(g->name).back() = -1;
      e = {"-1 that moves", "-1 for a block of group '" + g->name + "' that moves", Code::kInvalidArgument};
    } else if (which == 4) {
      if (gen::chance(rng, 50)) {
        in.request.blocks["no-such-group"] = GroupBlocks{{0}, {0}};
        e = {"unknown group", "a request naming an unknown group", Code::kInvalidArgument};
      } else {
        in.request.blocks.erase(in.request.blocks.begin());
        e = {"missing group", "a request missing a transfer group", Code::kInvalidArgument};
      }
    } else if (which == 5) {
      in.remotes.push_back(in.remotes[gen::draw(rng, 0, in.remotes.size() - 1)]);
      e = {"duplicate rank", "a duplicate remote rank", Code::kInvalidArgument};
    } else if (which == 6) {
      // Two overlaid groups given one local block id: an error, or (when the
      // written bytes happen not to meet) a plan that verifies.
      const std::vector<size_t> cls = gen::overlay_classes(in.local);
      std::vector<std::pair<size_t, size_t>> pairs;
      for (size_t a = 0; a < cls.size(); ++a) {
        for (size_t b = a + 1; b < cls.size(); ++b) {
          if (cls[a] == cls[b] && in.local.groups[a].transfer && in.local.groups[b].transfer) pairs.push_back({a, b});
        }
      }
      if (pairs.empty()) continue;
      auto [a, b] = gen::pick(rng, pairs);
      in.request.blocks.at(in.local.groups[b].name).local.back() =
          in.request.blocks.at(in.local.groups[a].name).local.back();
      e = {"overlay id clash",
           "overlaid groups '" + in.local.groups[a].name + "' and '" + in.local.groups[b].name +
               "' sharing a local block id",
           Code::kInvalidArgument, /*or_plan_that_verifies=*/true};
    } else if (which == 8) {
      // One local block id listed twice for moving blocks of one group.
      const Group* g = pick_group(rng, in.local, [&](const Group& x) {
        if (x.kind != GroupKind::kAttention && x.kind != GroupKind::kSlidingWindow) return false;
        const gen::PositionRange r = gen::moving_positions(x, in.request.num_tokens, in.request.skip_tokens);
        return r.count() > 0 && (r.end - 1) / x.positions_per_block() > r.first / x.positions_per_block() &&
               in.request.blocks.at(x.name).local.size() >= 2;
      });
      if (g == nullptr) continue;
      std::vector<int64_t>& ids = in.request.blocks.at(g->name).local;
      ids[ids.size() - 2] = ids.back();
      // Always an error: a block holds one stretch of a request.
      e = {"duplicate local id",
           "local block id " + std::to_string(ids.back()) + " listed twice in group '" + g->name + "'",
           Code::kInvalidArgument, /*or_plan_that_verifies=*/false};
    } else if (which == 9) {
      const Group* g = pick_group(rng, in.local, [](const Group& x) { return x.kind == GroupKind::kScratch; });
      if (g == nullptr) continue;
      list_of(g->name).push_back(list_of(g->name).front());
      e = {"scratch list of 2", "a scratch list of group '" + g->name + "' with two entries", Code::kInvalidArgument};
    } else if (which == 10) {
      if (in.remotes.size() < 2) continue;
      Layout& r = in.remotes[gen::draw(rng, 0, in.remotes.size() - 1)];
      r.tp_size *= 2;
      e = {"mixed tp_size", "remote ranks of different tp_size", Code::kIncompatible};
    } else if (which == 11) {
      // Remove every holder of one needed head of a component that moves.
      std::vector<NeededHead> candidates;
      for (const NeededHead& n : needed_heads(in.local)) {
        const Group* g = in.local.find_group(n.group);
        const bool moves = g->kind == GroupKind::kScratch || in.request.skip_tokens < in.request.num_tokens;
        if (!n.replicated && !n.empty && moves) candidates.push_back(n);
      }
      if (candidates.empty()) continue;
      const NeededHead n = gen::pick(rng, candidates);
      std::erase_if(in.remotes, [&](const Layout& r) { return holds(r, n); });
      if (in.remotes.empty()) continue;
      e = {"head not held", "no remote rank holding head " + std::to_string(n.head) + " of '" + n.component + "'",
           Code::kIncompatible};
    } else {
      gen::ModelRecipe other = c.recipe;
      std::string what;
      for (int tries = 0; tries < 20 && what.empty(); ++tries) what = mutate_identity(rng, other);
      if (what.empty()) continue;
      gen::InstanceShape shape = gen::random_instance(rng, other, c.remote_tp, c.request.num_tokens);
      in.remotes = gen::make_instance(other, shape);
      gen::RequestOptions o;
      o.num_tokens = c.request.num_tokens;
      o.skip_tokens = c.request.skip_tokens;
      o.local_unused_as_minus_one_percent = o.remote_unused_as_minus_one_percent = 0;
      in.request = gen::make_request(rng, in.local, in.remotes, o);
      e = {"identity", "a remote identity differing in " + what, Code::kIncompatible};
    }
    ++checked;
    ++counts[e.kind];
    Result<Plan> p = plan(in.local, in.remotes, in.request);
    std::string failure;
    if (p.has_value()) {
      if (!e.or_plan_that_verifies) {
        failure = "plan() returned a plan of " + std::to_string(p->descriptors.size()) + " descriptors";
      } else if (Result<VerifyReport> v = verify(*p, in.local, in.remotes, in.request, true); !v) {
        failure = "plan() returned a plan that fails verification: " + v.error().to_string();
      }
    } else if (p.error().code() != e.code) {
      failure = "plan() returned " + p.error().to_string() + ", expected code " + std::string(code_name(e.code));
    } else if (p.error().message().empty()) {
      failure = "plan() returned an error without a message";
    }
    if (!failure.empty()) {
      const std::string dir = dump(c, in, e.what + ": " + failure);
      ADD_FAILURE() << c.describe() << " (invalid-input variant): " << e.what << ": " << failure << "\n  written to "
                    << dir;
      if (++failures >= 5) break;
    }
  }
  std::printf("[ negative  ] %llu invalid inputs checked:", (unsigned long long)checked);
  for (const auto& [kind, n] : counts) std::printf(" %s: %llu;", kind.c_str(), (unsigned long long)n);
  std::printf("\n");
}

}  // namespace
}  // namespace kvbridge

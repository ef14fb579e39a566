// Test-only support for the planner's property tests (plan_property_test.cc,
// plan_property_errors_test.cc): the run's case count and seed from the
// environment, random cases (layouts of a random model, a covering subset of
// remote ranks, a request), the structural checks of a plan, and shrinking a
// failing case to a small reproduction written as JSON.
//
// Environment: KVB_PROPERTY_CASES (default 4000; 600 under sanitizers)
// scales the run; KVB_PROPERTY_SEED (default 20250601) changes it;
// KVB_PROPERTY_CASE runs one case only. A failure prints the seed and case
// index, shrinks the case (groups, layers, components, tokens) while it still
// fails the same way, and writes the reduced layouts and request as JSON under
// /tmp/kvb_property/seed_<seed>_case_<index>/.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"
#include "plan/random_request.h"

namespace kvbridge::property {

namespace gen = ::kvbridge::testing;

inline uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 10);
}

// Sanitizer builds run the verifier several times slower (even with the
// planner at -O1), so they run fewer cases: enough for the generator to reach
// every shape it makes (the tests check that it does). CMakeLists.txt
// defines KVB_PROPERTY_SANITIZED for the tests of a sanitizer build.
#ifdef KVB_PROPERTY_SANITIZED
inline constexpr uint64_t kDefaultCases = 600;
#else
inline constexpr uint64_t kDefaultCases = 4000;
#endif

inline uint64_t num_cases() { return env_u64("KVB_PROPERTY_CASES", kDefaultCases); }
inline uint64_t base_seed() { return env_u64("KVB_PROPERTY_SEED", 20250601); }

// The cases to run: all of [0, count), or the one KVB_PROPERTY_CASE names.
inline std::vector<uint64_t> case_indices(uint64_t count) {
  std::vector<uint64_t> out;
  if (const char* one = std::getenv("KVB_PROPERTY_CASE"); one != nullptr && *one != '\0') {
    out.push_back(std::strtoull(one, nullptr, 10));
    return out;
  }
  for (uint64_t i = 0; i < count; ++i) out.push_back(i);
  return out;
}

struct Case {
  uint64_t seed = 0;
  uint64_t index = 0;
  gen::ModelRecipe recipe;
  uint32_t remote_tp = 1;
  gen::InstanceShape local_shape;
  gen::InstanceShape remote_shape;
  Layout local;
  std::vector<Layout> remotes;
  Request request;
  std::string describe() const {
    return "seed " + std::to_string(seed) + " case " + std::to_string(index) +
           " (rerun: KVB_PROPERTY_SEED=" + std::to_string(seed) + " KVB_PROPERTY_CASE=" + std::to_string(index) + ")";
  }
};

inline gen::BlockIds random_ids(gen::Rng& rng) {
  return gen::pick(
      rng, std::vector<gen::BlockIds>{gen::BlockIds::kConsecutive, gen::BlockIds::kShuffled, gen::BlockIds::kRuns});
}

// One (group, layer, component, global head) the local rank holds; head 0
// of a replicated component.
struct NeededHead {
  std::string group, layer, component;
  uint32_t head = 0;
  bool replicated = false;
  bool empty = false;
};

inline std::vector<NeededHead> needed_heads(const Layout& local) {
  std::vector<NeededHead> out;
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    for (const Layer& l : g.layers) {
      if (!l.held) continue;
      for (const Component& c : l.components) {
        for (uint64_t h = 0; h < c.local_heads(); ++h) {
          out.push_back({g.name, l.name, c.name, c.heads ? static_cast<uint32_t>(c.heads->first + h) : 0,
                         !c.heads.has_value(), c.empty()});
        }
      }
    }
  }
  return out;
}

inline bool holds(const Layout& remote, const NeededHead& n) {
  const Group* g = remote.find_group(n.group);
  if (g == nullptr) return false;
  for (const Layer& l : g->layers) {
    if (l.name != n.layer || !l.held) continue;
    for (const Component& c : l.components) {
      if (c.name != n.component) continue;
      return n.replicated || (c.heads && c.heads->first <= n.head && n.head < c.heads->first + c.heads->count);
    }
  }
  return false;
}

// Remote ranks, in their given order, of which a random one holds each head
// the local rank needs.
inline std::vector<Layout> covering_subset(gen::Rng& rng, const Layout& local, const std::vector<Layout>& remotes) {
  std::vector<bool> keep(remotes.size(), false);
  for (const NeededHead& n : needed_heads(local)) {
    // One holder per context shard of the remote group (every shard, needed
    // or not: a superset still covers).
    const Group* g = remotes.front().find_group(n.group);
    const uint32_t shards = g ? g->context.size : 1;
    for (uint32_t s = 0; s < shards; ++s) {
      std::vector<size_t> holders;
      for (size_t r = 0; r < remotes.size(); ++r) {
        if (holds(remotes[r], n) && remotes[r].find_group(n.group)->context.rank == s) holders.push_back(r);
      }
      if (!holders.empty()) keep[gen::pick(rng, holders)] = true;
    }
  }
  std::vector<Layout> out;
  for (size_t r = 0; r < remotes.size(); ++r) {
    if (keep[r]) out.push_back(remotes[r]);
  }
  if (out.empty()) return remotes;  // nothing needed (no held layer transfers)
  return out;
}

// Builds case `index`; `rng` is left positioned for the case's further draws.
inline Case make_case(uint64_t seed, uint64_t index, gen::Rng& rng) {
  Case c;
  c.seed = seed;
  c.index = index;
  c.recipe = gen::random_recipe(rng);
  const std::vector<uint32_t> tps = gen::valid_tp_sizes(c.recipe, gen::chance(rng, 10) ? 16 : 8);
  const uint32_t local_tp = gen::pick(rng, tps);
  c.remote_tp = gen::pick(rng, tps);

  gen::RequestOptions o;
  const unsigned size = static_cast<unsigned>(gen::draw(rng, 0, 99));
  o.num_tokens = size < 50 ? gen::draw(rng, 1, 64) : size < 92 ? gen::draw(rng, 1, 300) : gen::draw(rng, 300, 1000);
  const unsigned skip = static_cast<unsigned>(gen::draw(rng, 0, 99));
  // Sometimes the receiver has every token: only scratch blocks move then.
  o.skip_tokens = skip < 40 ? 0 : skip < 97 ? gen::draw(rng, 0, o.num_tokens - 1) : o.num_tokens;

  c.local_shape = gen::random_instance(rng, c.recipe, local_tp, o.num_tokens);
  c.remote_shape = gen::random_instance(rng, c.recipe, c.remote_tp, o.num_tokens);
  const uint32_t rank = static_cast<uint32_t>(gen::draw(rng, 0, local_tp - 1));
  c.local = gen::make_rank_layout(c.recipe, c.local_shape, rank);
  c.remotes = gen::make_instance(c.recipe, c.remote_shape);
  if (gen::chance(rng, 10)) {
    // Ranks of one instance laid out differently (the model allows it):
    // same block sizes and num_blocks, each rank its own physical order.
    for (uint32_t r = 1; r < c.remote_tp; ++r) {
      const gen::InstanceShape own = gen::random_instance(rng, c.recipe, c.remote_tp, o.num_tokens, &c.remote_shape);
      c.remotes[r] = gen::make_rank_layout(c.recipe, own, r);
    }
  }
  // Sometimes pipeline stages: the remote instance's ranks split into 2 or
  // 3 stages, and the local rank one stage of its own instance.
  const std::vector<std::string> order = layer_order(c.local);
  if (order.size() >= 2 && gen::chance(rng, 20)) {
    const uint32_t pp = static_cast<uint32_t>(gen::draw(rng, 2, std::min<uint64_t>(3, order.size())));
    std::vector<Layout> staged;
    for (uint32_t s = 0; s < pp; ++s) {
      const std::set<std::string, std::less<>> held = pp_stage_layers(order, pp, s);
      for (const Layout& r : c.remotes) staged.push_back(as_pp_stage(r, pp, s, held));
    }
    c.remotes = std::move(staged);
  }
  if (order.size() >= 2 && gen::chance(rng, 15)) {
    const uint32_t pp = static_cast<uint32_t>(gen::draw(rng, 2, std::min<uint64_t>(3, order.size())));
    const uint32_t s = static_cast<uint32_t>(gen::draw(rng, 0, pp - 1));
    c.local = as_pp_stage(c.local, pp, s, pp_stage_layers(order, pp, s));
  }
  // Sometimes context parallelism: the remote instance's ranks, the local
  // rank, or both, split into context shards (any interleave, equal or not).
  const bool remote_cp = gen::chance(rng, 15), local_cp = gen::chance(rng, 15);
  if (remote_cp || local_cp) {
    const std::vector<uint64_t> interleaves{1, 1, 2, 3, 4, 8, 16};
    const uint64_t li = gen::pick(rng, interleaves);
    const uint64_t ri = gen::chance(rng, 50) ? li : gen::pick(rng, interleaves);
    if (remote_cp) {
      c.remotes = gen::context_sharded(c.remotes, static_cast<uint32_t>(gen::draw(rng, 2, 3)), ri);
    }
    if (local_cp) {
      const uint32_t size = static_cast<uint32_t>(gen::draw(rng, 2, 4));
      c.local = gen::as_context_shard(c.local, size, static_cast<uint32_t>(gen::draw(rng, 0, size - 1)), li);
    }
  }
  if (gen::chance(rng, 30)) gen::shuffle(rng, c.remotes);

  o.local_ids = random_ids(rng);
  o.remote_ids = gen::chance(rng, 70) ? o.local_ids : random_ids(rng);
  c.request = gen::make_request(rng, c.local, c.remotes, o);
  // Sometimes only some remote ranks: one holder of each head the local
  // rank needs (the planner must take a subset that holds them all).
  if (c.remotes.size() > 1 && gen::chance(rng, 15)) c.remotes = covering_subset(rng, c.local, c.remotes);
  return c;
}

// Stage options for a case over `local`: one to three layers per stage (all
// of them one time in ten), chunks of up to three of its largest blocks
// (none half the time).
inline StageOptions random_stage_options(gen::Rng& rng, const Layout& local) {
  uint64_t largest = 1;
  for (const Group& g : local.groups) largest = std::max(largest, g.block_tokens);
  StageOptions o;
  o.layers_per_stage = static_cast<uint32_t>(gen::chance(rng, 10) ? 0 : gen::draw(rng, 1, 3));
  o.chunk_tokens = gen::chance(rng, 50) ? 0 : gen::draw(rng, 1, 3 * largest);
  return o;
}

inline std::string plan_diff(const Plan& a, const Plan& b) {
  if (a.bytes != b.bytes) return "bytes differ: " + std::to_string(a.bytes) + " vs " + std::to_string(b.bytes);
  if (a.descriptors != b.descriptors) return "descriptors differ";
  if (a.sources.size() != b.sources.size()) return "source counts differ";
  for (size_t i = 0; i < a.sources.size(); ++i) {
    if (a.sources[i].tp_rank != b.sources[i].tp_rank || a.sources[i].bytes != b.sources[i].bytes ||
        a.sources[i].descriptors != b.sources[i].descriptors) {
      return "source " + std::to_string(i) + " totals differ";
    }
  }
  return "";
}

inline std::string describe(const Descriptor& d) {
  return "{source " + std::to_string(d.source) + ", local tensor " + std::to_string(d.local_tensor) + " offset " +
         std::to_string(d.local_offset) + ", remote tensor " + std::to_string(d.remote_tensor) + " offset " +
         std::to_string(d.remote_offset) + ", bytes " + std::to_string(d.bytes) + "}";
}

inline bool inside(uint64_t offset, uint64_t bytes, uint64_t tensor_bytes) {
  return offset <= tensor_bytes && bytes <= tensor_bytes - offset;
}

// Checks of the plan's own structure that need no simulation. Empty when fine.
inline std::string check_structure(const Plan& p, const Layout& local, const std::vector<Layout>& remotes) {
  if (p.sources.size() != remotes.size()) {
    return "plan has " + std::to_string(p.sources.size()) + " source totals for " + std::to_string(remotes.size()) +
           " remote layouts";
  }
  std::vector<SourceTotals> totals(remotes.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < p.descriptors.size(); ++i) {
    const Descriptor& d = p.descriptors[i];
    const std::string at = "descriptor " + std::to_string(i) + " " + describe(d) + ": ";
    if (d.bytes == 0) return at + "zero length";
    if (d.source >= remotes.size()) return at + "source out of range";
    if (d.local_tensor >= local.tensors.size()) return at + "local tensor out of range";
    if (d.remote_tensor >= remotes[d.source].tensors.size()) return at + "remote tensor out of range";
    if (!inside(d.local_offset, d.bytes, local.tensors[d.local_tensor].bytes)) {
      return at + "past the end of local tensor '" + local.tensors[d.local_tensor].name + "' (" +
             std::to_string(local.tensors[d.local_tensor].bytes) + " bytes)";
    }
    const Tensor& rt = remotes[d.source].tensors[d.remote_tensor];
    if (!inside(d.remote_offset, d.bytes, rt.bytes)) {
      return at + "past the end of remote tensor '" + rt.name + "' (" + std::to_string(rt.bytes) + " bytes)";
    }
    if (i > 0) {
      const Descriptor& prev = p.descriptors[i - 1];
      if (prev.local_tensor > d.local_tensor ||
          (prev.local_tensor == d.local_tensor && prev.local_offset > d.local_offset)) {
        return at + "not in local (tensor, offset) order after " + describe(prev);
      }
      if (prev.local_tensor == d.local_tensor && prev.local_offset + prev.bytes > d.local_offset) {
        return at + "writes local bytes that " + describe(prev) + " also writes";
      }
    }
    totals[d.source].descriptors += 1;
    totals[d.source].bytes += d.bytes;
    bytes += d.bytes;
  }
  if (bytes != p.bytes)
    return "plan.bytes " + std::to_string(p.bytes) + " but descriptors sum to " + std::to_string(bytes);
  for (size_t s = 0; s < remotes.size(); ++s) {
    if (p.sources[s].tp_rank != remotes[s].tp_rank || p.sources[s].descriptors != totals[s].descriptors ||
        p.sources[s].bytes != totals[s].bytes) {
      return "source " + std::to_string(s) + " totals {tp_rank " + std::to_string(p.sources[s].tp_rank) + ", " +
             std::to_string(p.sources[s].descriptors) + " descriptors, " + std::to_string(p.sources[s].bytes) +
             " bytes} but the descriptors give {tp_rank " + std::to_string(remotes[s].tp_rank) + ", " +
             std::to_string(totals[s].descriptors) + ", " + std::to_string(totals[s].bytes) + "}";
    }
  }
  return "";
}

struct Outcome {
  std::string failure;  // empty: passed
  std::string kind;     // a short category, kept while shrinking
  uint64_t descriptors = 0;
  uint64_t bytes = 0;
};

// Every positive property of one (local, remotes, request).
inline Outcome check(const Layout& local, const std::vector<Layout>& remotes, const Request& request) {
  Outcome out;
  auto fail = [&](std::string kind, std::string message) {
    out.kind = std::move(kind);
    out.failure = out.kind + ": " + message;
    return out;
  };
  Result<Plan> p = plan(local, remotes, request);
  if (!p) return fail("plan error", p.error().to_string());
  // The second call gets copies, so a plan that depends on addresses (an
  // order by pointer, say) differs.
  const Layout local_copy = local;
  const std::vector<Layout> remotes_copy = remotes;
  const Request request_copy = request;
  Result<Plan> again = plan(local_copy, remotes_copy, request_copy);
  if (!again) return fail("nondeterministic", "the second call failed: " + again.error().to_string());
  if (std::string d = plan_diff(*p, *again); !d.empty()) return fail("nondeterministic", d);
  if (std::string s = check_structure(*p, local, remotes); !s.empty()) return fail("structure", s);
  const uint64_t expected = gen::expected_bytes(local, request);
  Result<VerifyReport> v = verify(*p, local, remotes, request, /*check_minimal=*/true);
  if (!v) return fail("verify", v.error().to_string());
  if (v->bytes_written != p->bytes) {
    return fail("verify report",
                "bytes_written " + std::to_string(v->bytes_written) + " but plan.bytes " + std::to_string(p->bytes));
  }
  if (v->bytes_checked != expected) {
    return fail("verify report", "bytes_checked " + std::to_string(v->bytes_checked) + " but the request moves " +
                                     std::to_string(expected) + " bytes");
  }
  if (p->bytes != expected) {
    return fail("bytes", "plan moves " + std::to_string(p->bytes) + " bytes, the request " + std::to_string(expected));
  }
  out.descriptors = p->descriptors.size();
  out.bytes = p->bytes;
  return out;
}

// ---------------------------------------------------------------------------
// Shrinking and dumping a failing case.

struct Inputs {
  Layout local;
  std::vector<Layout> remotes;
  Request request;
};

inline bool all_valid(const Inputs& in) {
  if (!validate(in.local).ok()) return false;
  for (const Layout& r : in.remotes) {
    if (!validate(r).ok()) return false;
  }
  return true;
}

// Applies `edit` to the local and every remote layout.
template <typename F>
Inputs edit_layouts(const Inputs& in, F edit) {
  Inputs out = in;
  edit(out.local);
  for (Layout& r : out.remotes) edit(r);
  return out;
}

inline std::vector<Inputs> reductions(const Inputs& in) {
  std::vector<Inputs> out;
  const Layout& l = in.local;
  for (size_t g = 0; g < l.groups.size() && l.groups.size() > 1; ++g) {
    const std::string name = l.groups[g].name;
    Inputs r =
        edit_layouts(in, [&](Layout& x) { std::erase_if(x.groups, [&](const Group& y) { return y.name == name; }); });
    r.request.blocks.erase(name);
    out.push_back(std::move(r));
  }
  for (const Group& g : l.groups) {
    for (size_t li = 0; li < g.layers.size() && g.layers.size() > 1; ++li) {
      const std::string layer = g.layers[li].name;
      out.push_back(edit_layouts(in, [&](Layout& x) {
        for (Group& y : x.groups) {
          if (y.name == g.name) std::erase_if(y.layers, [&](const Layer& z) { return z.name == layer; });
        }
      }));
    }
    for (const Layer& layer : g.layers) {
      for (size_t ci = 0; ci < layer.components.size() && layer.components.size() > 1; ++ci) {
        const std::string comp = layer.components[ci].name;
        out.push_back(edit_layouts(in, [&](Layout& x) {
          for (Group& y : x.groups) {
            if (y.name != g.name) continue;
            for (Layer& z : y.layers) {
              if (z.name == layer.name) std::erase_if(z.components, [&](const Component& w) { return w.name == comp; });
            }
          }
        }));
      }
    }
  }
  // Fewer tokens: drop whole blocks from the end of every token list.
  if (in.request.num_tokens > 1 && !in.remotes.empty()) {
    for (uint64_t tokens : {in.request.num_tokens / 2, in.request.num_tokens - 1}) {
      if (tokens == 0) continue;
      Inputs r = in;
      r.request.num_tokens = tokens;
      r.request.skip_tokens = std::min(r.request.skip_tokens, tokens - 1);
      for (auto& [name, lists] : r.request.blocks) {
        const Group* lg = r.local.find_group(name);
        const Group* rg = r.remotes[0].find_group(name);
        if (lg == nullptr || rg == nullptr) continue;
        if (lg->kind == GroupKind::kAttention || lg->kind == GroupKind::kSlidingWindow) {
          lists.local.resize(std::min(lists.local.size(), gen::token_list_length(lg->block_tokens, tokens)));
          lists.remote.resize(std::min(lists.remote.size(), gen::token_list_length(rg->block_tokens, tokens)));
        }
      }
      out.push_back(std::move(r));
    }
  }
  if (in.request.skip_tokens > 0) {
    Inputs r = in;
    r.request.skip_tokens = 0;
    out.push_back(std::move(r));
  }
  return out;
}

inline Inputs shrink(Inputs in, const std::string& kind) {
  for (int round = 0; round < 200; ++round) {
    bool reduced = false;
    for (Inputs& r : reductions(in)) {
      if (!all_valid(r)) continue;
      Outcome o = check(r.local, r.remotes, r.request);
      if (!o.failure.empty() && o.kind == kind) {
        in = std::move(r);
        reduced = true;
        break;
      }
    }
    if (!reduced) break;
  }
  return in;
}

inline std::string dump(const Case& c, const Inputs& in, const std::string& failure) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::path("/tmp/kvb_property") / ("seed_" + std::to_string(c.seed) + "_case_" + std::to_string(c.index));
  std::error_code ec;
  fs::create_directories(dir, ec);
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(dir / name) << text << "\n"; };
  write("local.json", to_json(in.local));
  for (size_t i = 0; i < in.remotes.size(); ++i) write("remote." + std::to_string(i) + ".json", to_json(in.remotes[i]));
  write("request.json", to_json(in.request));
  write("failure.txt", c.describe() + "\n" + failure);
  return dir.string();
}

// Reports a failing case: shrunk, dumped, with the seed and index.
inline void report(const Case& c, const Outcome& o) {
  Inputs reduced = shrink(Inputs{c.local, c.remotes, c.request}, o.kind);
  const Outcome again = check(reduced.local, reduced.remotes, reduced.request);
  const std::string dir = dump(c, reduced, again.failure);
  ADD_FAILURE() << c.describe() << ": " << o.failure << "\n  reduced case (" << reduced.local.groups.size()
                << " groups, " << reduced.request.num_tokens << " tokens): " << again.failure << "\n  written to "
                << dir;
}

}  // namespace kvbridge::property

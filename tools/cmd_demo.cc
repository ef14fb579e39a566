// `kvbridge demo`: the main job until the P/D demo with real processes lands.
// It builds the layouts of a prefill instance and a decode instance from a
// preset, makes requests of varied lengths with prefix hits, plans every
// decode rank's pull, verifies every byte, and prints what each plan moves
// against the one-descriptor-per-(layer, component, block) scheme.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"

namespace kvbridge::cli {
namespace {

struct Side {
  uint32_t tp = 1;
  uint64_t block_tokens = 0;
  uint64_t kernel_block_tokens = 0;
  std::string order = "LBHNC";
};

struct DemoArgs {
  std::string preset = "glm5-flash";
  Side prefill{2, 2304, 64, "BLHNC"};
  Side decode{4, 2304, 128, "BLHNC"};
  uint32_t requests = 4;
  uint64_t num_blocks = 64;
  uint64_t seed = 1;
};

Result<std::vector<Layout>> instance(const std::string& preset, const Side& s, uint64_t num_blocks) {
  std::vector<Layout> ranks;
  KVB_ASSIGN_OR_RETURN(Order order, parse_order(s.order));
  for (uint32_t r = 0; r < s.tp; ++r) {
    PresetOptions o;
    o.name = preset;
    o.tp_size = s.tp;
    o.tp_rank = r;
    o.block_tokens = s.block_tokens;
    o.kernel_block_tokens = s.kernel_block_tokens;
    o.order = order;
    o.num_blocks = num_blocks;
    KVB_ASSIGN_OR_RETURN(Layout l, make_preset(o));
    ranks.push_back(std::move(l));
  }
  return ranks;
}

// Block ids for `count` blocks out of `num_blocks`, drawn without repeats.
std::vector<int64_t> draw(std::mt19937_64& rng, std::vector<int64_t>& pool, uint64_t count) {
  std::vector<int64_t> ids;
  for (uint64_t i = 0; i < count && !pool.empty(); ++i) {
    // Mostly consecutive runs, as allocators hand out, with some jumps.
    size_t at = rng() % 4 == 0 ? rng() % pool.size() : 0;
    ids.push_back(pool[at]);
    pool.erase(pool.begin() + static_cast<long>(at));
  }
  return ids;
}

Result<Request> make_request(std::mt19937_64& rng, const Layout& d, const Layout& p, uint64_t tokens, uint64_t skip) {
  Request q;
  q.num_tokens = tokens;
  q.skip_tokens = skip;
  // Each side has one pool of block ids shared by all its groups (overlaid
  // groups must not share an id).
  std::vector<int64_t> dpool, ppool;
  for (uint64_t b = 0; b < d.groups[0].num_blocks; ++b) dpool.push_back(static_cast<int64_t>(b));
  for (uint64_t b = 0; b < p.groups[0].num_blocks; ++b) ppool.push_back(static_cast<int64_t>(b));
  for (const Group& g : d.groups) {
    if (!g.transfer) continue;
    const Group* pg = p.find_group(g.name);
    auto blocks = [&](const Group& grp) {
      if (grp.kind == GroupKind::kScratch || grp.kind == GroupKind::kState) return uint64_t{1};
      const uint64_t per = grp.block_tokens;
      return (tokens + per - 1) / per;
    };
    const uint64_t dn = blocks(g), pn = blocks(*pg);
    if (dn > dpool.size() || pn > ppool.size()) {
      return Status::resource_exhausted("a request of " + std::to_string(tokens) +
                                        " tokens needs more blocks than --num-blocks gives");
    }
    q.blocks[g.name] = {draw(rng, dpool, dn), draw(rng, ppool, pn)};
  }
  return q;
}

int run_demo(const DemoArgs& a) {
  Result<std::vector<Layout>> prefill = instance(a.preset, a.prefill, a.num_blocks);
  if (!prefill) return fail(prefill.error().with_context("prefill"));
  Result<std::vector<Layout>> decode = instance(a.preset, a.decode, a.num_blocks);
  if (!decode) return fail(decode.error().with_context("decode"));
  auto blocks = [](const Side& s, const Layout& l) {
    std::string b = std::to_string(l.groups[0].block_tokens);
    if (s.kernel_block_tokens != 0) b += "/" + std::to_string(s.kernel_block_tokens) + "-token kernel blocks";
    return b;
  };
  std::printf("kvbridge demo: %s, prefill TP %u (%s, block %s) -> decode TP %u (%s, block %s)\n", a.preset.c_str(),
              a.prefill.tp, a.prefill.order.c_str(), blocks(a.prefill, (*prefill)[0]).c_str(), a.decode.tp,
              a.decode.order.c_str(), blocks(a.decode, (*decode)[0]).c_str());
  std::printf("compatibility hash %s on both sides\n\n", compatibility_hash_hex((*prefill)[0]).c_str());
  std::printf("%-4s %-7s %-7s %-5s %12s %14s %12s %8s %10s  %s\n", "req", "tokens", "cached", "rank", "descriptors",
              "bytes", "naive", "ratio", "plan_us", "verified");
  std::mt19937_64 rng(a.seed);
  // Every group of a side draws from one pool of block ids (overlaid groups
  // never share one), so a request may use a share of the pool per group.
  uint64_t token_groups = 0, min_block = ~uint64_t{0};
  for (const Layout* l : {&(*prefill)[0], &(*decode)[0]}) {
    for (const Group& g : l->groups) {
      if (g.kind != GroupKind::kAttention && g.kind != GroupKind::kSlidingWindow) continue;
      token_groups += l == &(*prefill)[0] ? 1 : 0;
      min_block = std::min(min_block, g.block_tokens);
    }
  }
  const uint64_t share = (a.num_blocks - std::min<uint64_t>(a.num_blocks, 8)) / std::max<uint64_t>(token_groups, 1);
  const uint64_t max_tokens = std::max<uint64_t>(1, share * min_block);
  uint64_t total_desc = 0, total_naive = 0, total_bytes = 0;
  for (uint32_t i = 0; i < a.requests; ++i) {
    const uint64_t tokens = 1 + rng() % max_tokens;
    const uint64_t skip = i % 2 == 1 ? rng() % tokens : 0;
    for (uint32_t r = 0; r < a.decode.tp; ++r) {
      const Layout& local = (*decode)[r];
      std::mt19937_64 req_rng(a.seed * 1000 + i);  // one request, same ids on every rank
      Result<Request> q = make_request(req_rng, local, (*prefill)[0], tokens, skip);
      if (!q) return fail(q.error());
      const auto t0 = std::chrono::steady_clock::now();
      Result<Plan> p = plan(local, *prefill, *q);
      const auto t1 = std::chrono::steady_clock::now();
      if (!p) return fail(p.error());
      Result<VerifyReport> v = verify(*p, local, *prefill, *q);
      if (!v) return fail(v.error().with_context("rank " + std::to_string(r)));
      const uint64_t naive = naive_descriptor_count(local, *prefill, *q);
      total_desc += p->descriptors.size();
      total_naive += naive;
      total_bytes += p->bytes;
      std::printf("%-4u %-7llu %-7llu %-5u %12zu %14llu %12llu %7.1fx %10.1f  yes (%llu cells)\n", i,
                  static_cast<unsigned long long>(tokens), static_cast<unsigned long long>(skip), r,
                  p->descriptors.size(), static_cast<unsigned long long>(p->bytes),
                  static_cast<unsigned long long>(naive),
                  p->descriptors.empty() ? 0.0 : static_cast<double>(naive) / p->descriptors.size(),
                  std::chrono::duration<double, std::micro>(t1 - t0).count(),
                  static_cast<unsigned long long>(v->cells_checked));
    }
  }
  std::printf("\nall %u requests x %u decode ranks verified byte-exact: %llu descriptors for %llu bytes "
              "(the per-(layer, component, block) scheme: %llu)\n",
              a.requests, a.decode.tp, static_cast<unsigned long long>(total_desc),
              static_cast<unsigned long long>(total_bytes), static_cast<unsigned long long>(total_naive));
  return 0;
}

void add_side(CLI::App* app, const std::string& name, Side& s) {
  app->add_option("--" + name + "-tp", s.tp, "TP size of the " + name + " instance")->capture_default_str();
  app->add_option("--" + name + "-block-tokens", s.block_tokens, name + " logical block tokens (0: preset default)")
      ->capture_default_str();
  app->add_option("--" + name + "-kernel-block-tokens", s.kernel_block_tokens,
                  name + " kernel block tokens (0: preset default)")
      ->capture_default_str();
  app->add_option("--" + name + "-order", s.order, name + " order: LBHNC, LBNHC or BLHNC")->capture_default_str();
}

}  // namespace

Command add_demo_command(CLI::App& root) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* app = root.add_subcommand(
      "demo", "Plan and verify prefill -> decode pulls for a preset across TP sizes, block sizes and orders");
  app->add_option("--preset", args->preset, "Preset (see `kvbridge presets`)")->capture_default_str();
  add_side(app, "prefill", args->prefill);
  add_side(app, "decode", args->decode);
  app->add_option("--requests", args->requests, "Number of requests")->capture_default_str();
  app->add_option("--num-blocks", args->num_blocks, "Blocks per group on each side")->capture_default_str();
  app->add_option("--seed", args->seed, "Seed of the request generator")->capture_default_str();
  return {app, [args] { return run_demo(*args); }};
}

}  // namespace kvbridge::cli

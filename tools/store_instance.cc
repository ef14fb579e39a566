// Synthetic instances for `kvbridge store`: see store_bench.h.
#include <random>

#include "kvbridge/content.h"
#include "kvbridge/presets.h"
#include "store_bench.h"

namespace kvbridge::cli {
namespace {

Request make_request(const Layout& l, uint64_t num_tokens, int64_t first, int64_t stride) {
  Request r;
  r.num_tokens = num_tokens;
  for (size_t gi = 0; gi < l.groups.size(); ++gi) {
    const Group& g = l.groups[gi];
    if (!g.transfer) continue;
    GroupBlocks& b = r.blocks[g.name];
    const uint64_t n = g.kind == GroupKind::kScratch ? 1 : (num_tokens + g.block_tokens - 1) / g.block_tokens;
    for (uint64_t i = 0; i < n; ++i)
      b.local.push_back(first + static_cast<int64_t>(gi) * stride + static_cast<int64_t>(i));
    b.remote = b.local;
  }
  return r;
}

}  // namespace

Result<std::unique_ptr<RankMem>> RankMem::create(Layout l) {
  auto m = std::make_unique<RankMem>();
  m->layout = std::move(l);
  for (const Tensor& t : m->layout.tensors) {
    KVB_ASSIGN_OR_RETURN(HostMemory bytes, HostMemory::allocate(t.bytes));
    m->spans.push_back(bytes.span());
    m->bytes.push_back(std::move(bytes));
  }
  return m;
}

std::vector<uint32_t> synthetic_tokens(uint64_t seed, uint64_t n) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = static_cast<uint32_t>(rng() % 150000);
  return t;
}

Result<SyntheticInstance> SyntheticInstance::create(std::shared_ptr<Store> store, const StoreArgs& a,
                                                    uint64_t max_tokens) {
  KVB_ASSIGN_OR_RETURN(Order order, parse_order(a.order));
  PresetOptions o;
  o.name = a.preset;
  o.tp_size = a.tp;
  o.block_tokens = a.block_tokens;
  o.order = order;
  o.num_blocks = 1;
  KVB_ASSIGN_OR_RETURN(Layout probe, make_preset(o));
  uint64_t bt = UINT64_MAX;
  for (const Group& g : probe.groups) {
    if (g.kind != GroupKind::kScratch) bt = std::min(bt, g.block_tokens);
  }
  const uint64_t per_group = std::max<uint64_t>(1, (max_tokens + bt - 1) / bt);
  SyntheticInstance inst;
  o.num_blocks = 1 + per_group;
  if (has_overlay(probe)) {
    inst.stride = static_cast<int64_t>(per_group);
    o.num_blocks = 1 + per_group * probe.groups.size();
  }
  if (a.rank >= static_cast<int64_t>(a.tp)) {
    return Status::invalid_argument("--rank " + std::to_string(a.rank) + " is not below --tp " + std::to_string(a.tp));
  }
  for (uint32_t r = 0; r < a.tp; ++r) {
    if (a.rank >= 0 && r != static_cast<uint64_t>(a.rank)) continue;
    o.tp_rank = r;
    KVB_ASSIGN_OR_RETURN(Layout l, make_preset(o));
    KVB_ASSIGN_OR_RETURN(RankStore rs, RankStore::create(store, l));
    KVB_ASSIGN_OR_RETURN(std::unique_ptr<RankMem> mem, RankMem::create(std::move(l)));
    inst.ranks.push_back(std::move(mem));
    inst.stores.push_back(std::move(rs));
  }
  return inst;
}

Request SyntheticInstance::request(size_t rank, uint64_t n) const {
  return make_request(ranks[rank]->layout, n, 1, stride);
}

Status SyntheticInstance::fill(uint64_t n, uint64_t seed) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    RankMem& m = *ranks[r];
    for (const Group& g : m.layout.groups) {
      if (g.kind != GroupKind::kState) continue;
      for (uint64_t t = g.block_tokens; t < n; t += g.block_tokens) {
        KVB_RETURN_IF_ERROR(fill_request(m.layout, request(r, t), RequestSide::kLocal, 0, seed, m.memory()));
      }
    }
    KVB_RETURN_IF_ERROR(fill_request(m.layout, request(r, n), RequestSide::kLocal, 0, seed, m.memory()));
  }
  return Status();
}

Result<PutResult> SyntheticInstance::put(std::span<const uint32_t> tokens, uint64_t n) {
  PutResult total;
  for (size_t r = 0; r < ranks.size(); ++r) {
    KVB_ASSIGN_OR_RETURN(PutResult p, stores[r].put(tokens, request(r, n), ranks[r]->memory()));
    total.parts_written += p.parts_written;
    total.objects_present += p.objects_present;
    total.objects_published += p.objects_published;
    total.objects_rejected += p.objects_rejected;
    total.bytes_copied += p.bytes_copied;
  }
  return total;
}

Result<GetCheck> SyntheticInstance::check(uint64_t hit, uint64_t seed) {
  GetCheck out;
  out.hit_tokens = hit;
  for (size_t r = 0; r < ranks.size() && hit > 0; ++r) {
    RankMem& m = *ranks[r];
    Layout view = m.layout;
    for (Group& grp : view.groups)
      grp.transfer = grp.transfer && grp.prefix_cacheable && grp.kind != GroupKind::kScratch;
    KVB_ASSIGN_OR_RETURN(ContentReport c,
                         check_request(view, request(r, hit), RequestSide::kLocal, 0, seed, m.memory()));
    out.cells += c.cells;
    out.bad_cells += c.bad_cells;
    if (out.first_error.empty()) out.first_error = c.first_error;
  }
  return out;
}

Result<GetCheck> SyntheticInstance::get_and_check(std::span<const uint32_t> tokens, uint64_t n, uint64_t seed) {
  GetCheck out;
  out.hit_tokens = UINT64_MAX;
  for (size_t r = 0; r < ranks.size(); ++r) {
    RankMem& m = *ranks[r];
    KVB_ASSIGN_OR_RETURN(GetResult g, stores[r].get(tokens, request(r, n), m.memory()));
    out.hit_tokens = std::min(out.hit_tokens, g.hit_tokens);
    out.bytes_copied += g.bytes_copied;
    out.memory_objects += g.memory_objects;
    out.disk_objects += g.disk_objects;
    out.redis_objects += g.redis_objects;
    if (g.hit_tokens == 0) continue;
    // Check only what the store keeps (not scratch groups).
    Layout view = m.layout;
    for (Group& grp : view.groups)
      grp.transfer = grp.transfer && grp.prefix_cacheable && grp.kind != GroupKind::kScratch;
    KVB_ASSIGN_OR_RETURN(ContentReport c,
                         check_request(view, request(r, g.hit_tokens), RequestSide::kLocal, 0, seed, m.memory()));
    out.cells += c.cells;
    out.bad_cells += c.bad_cells;
    if (out.first_error.empty()) out.first_error = c.first_error;
  }
  if (out.hit_tokens == UINT64_MAX) out.hit_tokens = 0;
  return out;
}

}  // namespace kvbridge::cli

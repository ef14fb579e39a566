// Group selection and the lookup rule: see selection.h and docs/store.md.
#include "store/selection.h"

#include <algorithm>
#include <string>

namespace kvbridge::store_internal {
namespace {

uint64_t window_first_block(const Group& g, uint64_t end_tokens, uint64_t H) {
  const uint64_t w = g.window_tokens.value_or(end_tokens);
  return end_tokens > w ? (end_tokens - w) / H : 0;
}

}  // namespace

Result<std::vector<Selected>> select_blocks(const Group& g, std::span<const int64_t> ids, uint64_t num_tokens,
                                            uint64_t skip_tokens, uint64_t H) {
  std::vector<Selected> out;
  if (!g.prefix_cacheable || !g.transfer || g.kind == GroupKind::kScratch) return out;
  const uint64_t n = num_tokens / H;
  const uint64_t bt = g.block_tokens;
  const uint64_t needed = g.entries_for_tokens(num_tokens);
  if (ids.size() < needed) {
    return Status::invalid_argument("store: group '" + g.name + "': " + std::to_string(ids.size()) + " block ids for " +
                                    std::to_string(num_tokens) + " tokens of " + std::to_string(bt) +
                                    "-token blocks (need " + std::to_string(needed) + ")");
  }
  // Hash block j starts at token j * H.
  auto listed = [&](uint64_t j) { return ids[g.slot_of_token(j * H).entry] >= 0; };
  switch (g.kind) {
    case GroupKind::kAttention:
      for (uint64_t j = skip_tokens / H; j < n; ++j) {
        if (listed(j)) out.push_back({j, -1});
      }
      break;
    case GroupKind::kSlidingWindow:
      for (uint64_t j = window_first_block(g, n * H, H); j < n; ++j) {
        if (listed(j)) out.push_back({j, -1});
      }
      break;
    case GroupKind::kState:
      for (uint64_t i = 0; i < needed; ++i) {
        if (ids[i] < 0) continue;
        const uint64_t t = i + 1 == needed ? num_tokens : (i + 1) * bt;
        if (t % H != 0 || t == 0 || t <= skip_tokens) continue;
        out.push_back({t / H - 1, ids[i]});
      }
      break;
    case GroupKind::kScratch:
      break;
  }
  return out;
}

uint64_t hit_tokens(std::span<const GroupPresence> groups, uint64_t H, uint64_t align_tokens, uint64_t limit_tokens) {
  if (align_tokens == 0 || H == 0) return 0;
  uint64_t t_max = limit_tokens;
  for (const GroupPresence& gp : groups) {
    const uint64_t n = gp.present.size();
    t_max = std::min(t_max, n * H);
    if (gp.group->kind != GroupKind::kAttention) continue;
    uint64_t p = 0;
    while (p < n && gp.present[p]) ++p;
    t_max = std::min(t_max, p * H);
  }
  for (uint64_t t = t_max / align_tokens * align_tokens; t > 0; t -= align_tokens) {
    bool ok = true;
    for (const GroupPresence& gp : groups) {
      if (gp.group->kind == GroupKind::kSlidingWindow) {
        for (uint64_t j = window_first_block(*gp.group, t, H); ok && j < t / H; ++j) ok = gp.present[j] != 0;
      } else if (gp.group->kind == GroupKind::kState) {
        ok = gp.present[t / H - 1] != 0;
      }
      if (!ok) break;
    }
    if (ok) return t;
  }
  return 0;
}

std::vector<uint64_t> needed_blocks(const Group& g, uint64_t hit, uint64_t skip_tokens, uint64_t H) {
  std::vector<uint64_t> out;
  if (hit == 0 || hit <= skip_tokens) return out;
  switch (g.kind) {
    case GroupKind::kAttention:
      for (uint64_t j = skip_tokens / H; j < hit / H; ++j) out.push_back(j);
      break;
    case GroupKind::kSlidingWindow:
      for (uint64_t j = window_first_block(g, hit, H); j < hit / H; ++j) {
        if ((j + 1) * H > skip_tokens) out.push_back(j);
      }
      break;
    case GroupKind::kState:
      out.push_back(hit / H - 1);
      break;
    case GroupKind::kScratch:
      break;
  }
  return out;
}

}  // namespace kvbridge::store_internal

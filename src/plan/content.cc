// Deterministic KV content: see kvbridge/content.h.
#include "kvbridge/content.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "plan/moving.h"

namespace kvbridge {
namespace {

using plan_internal::mix;

uint64_t name_hash(std::string_view s) {  // FNV-1a: stable, no per-process seed
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

constexpr uint64_t kFinalState = ~uint64_t{0};

// Writes the pattern of one cell (a word at a time) into `out`.
void pattern(uint64_t seed, uint64_t n, uint8_t* out) {
  uint64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const uint64_t w = mix(seed + k / 8);
    std::memcpy(out + k, &w, 8);
  }
  if (k < n) {
    const uint64_t w = mix(seed + k / 8);
    std::memcpy(out + k, &w, n - k);
  }
}

struct CellVisit {
  size_t tensor;
  uint64_t offset, bytes, token, seed;  // seed: of the coordinate, before the request seed
  const char* group;
  const char* layer_name;
  const char* component_name;
  size_t layer, component;
  uint64_t position, head;
};

Status walk(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token,
            const std::function<void(const CellVisit&)>& fn) {
  for (const Group& g : layout.groups) {
    if (!g.transfer) continue;
    auto it = request.blocks.find(g.name);
    if (it == request.blocks.end()) {
      return Status::invalid_argument("request has no block list for group '" + g.name + "'");
    }
    const std::vector<int64_t>& ids = side == RequestSide::kLocal ? it->second.local : it->second.remote;
    const uint64_t ppb = g.positions_per_block();
    const plan_internal::Moving m = plan_internal::moving_positions(g, request, first_token);
    const uint64_t gseed = name_hash(g.name);
    for (uint64_t p = m.first; p < m.last; ++p) {
      // A context-sharded rank holds its shard's positions, numbered densely.
      if (!g.context.holds(p)) continue;
      const uint64_t at = g.context.local_of(p);
      uint64_t entry = at / ppb, in_block = at % ppb, semantic = p, token = p * g.tokens_per_state;
      if (g.kind == GroupKind::kState) {
        if (ids.empty()) return Status::invalid_argument("group '" + g.name + "': empty block list");
        entry = ids.size() - 1;
        in_block = 0;
        semantic = kFinalState;
        token = request.num_tokens - 1;
      } else if (g.kind == GroupKind::kScratch) {
        entry = 0;
        token = 0;
      }
      if (entry >= ids.size()) {
        return Status::invalid_argument("group '" + g.name + "': block list of " + std::to_string(ids.size()) +
                                        " entries is too short for position " + std::to_string(p));
      }
      if (ids[entry] < 0) continue;
      const uint64_t block = static_cast<uint64_t>(ids[entry]);
      if (block >= g.num_blocks) {
        return Status::invalid_argument("group '" + g.name + "': block id " + std::to_string(block) +
                                        " is past num_blocks " + std::to_string(g.num_blocks));
      }
      for (size_t l = 0; l < g.layers.size(); ++l) {
        for (size_t c = 0; c < g.layers[l].components.size(); ++c) {
          const Component& comp = g.layers[l].components[c];
          if (comp.empty()) continue;
          const size_t t = static_cast<size_t>(layout.find_tensor(comp.tensor) - layout.tensors.data());
          for (uint64_t h = 0; h < comp.local_heads(); ++h) {
            const uint64_t global = comp.heads ? comp.heads->first + h : 0;
            KVB_ASSIGN_OR_RETURN(uint64_t off, cell_offset(comp, {block, h, in_block}));
            const uint64_t seed = mix(mix(mix(mix(mix(gseed) ^ l) ^ c) ^ semantic) ^ global);
            fn(CellVisit{t, off, comp.cell_bytes, token, seed, g.name.c_str(), g.layers[l].name.c_str(),
                         comp.name.c_str(), l, c, semantic, global});
          }
        }
      }
    }
  }
  return Status();
}

}  // namespace

Status for_each_cell(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token,
                     const std::function<void(size_t, uint64_t, uint64_t, uint64_t)>& cell) {
  return walk(layout, request, side, first_token,
              [&](const CellVisit& v) { cell(v.tensor, v.offset, v.bytes, v.token); });
}

Status fill_request(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token, uint64_t seed,
                    TensorMemory tensors) {
  KVB_RETURN_IF_ERROR(check_memory(layout, tensors));
  return walk(layout, request, side, first_token,
              [&](const CellVisit& v) { pattern(mix(v.seed ^ seed), v.bytes, tensors[v.tensor].data() + v.offset); });
}

Result<ContentReport> check_request(const Layout& layout, const Request& request, RequestSide side,
                                    uint64_t first_token, uint64_t seed, TensorMemory tensors) {
  KVB_RETURN_IF_ERROR(check_memory(layout, tensors));
  ContentReport report;
  std::vector<uint8_t> want;
  KVB_RETURN_IF_ERROR(walk(layout, request, side, first_token, [&](const CellVisit& v) {
    want.resize(v.bytes);
    pattern(mix(v.seed ^ seed), v.bytes, want.data());
    const uint8_t* got = tensors[v.tensor].data() + v.offset;
    ++report.cells;
    report.bytes += v.bytes;
    if (std::memcmp(got, want.data(), v.bytes) == 0) return;
    if (report.bad_cells == 0 || v.token < report.first_bad_token) report.first_bad_token = v.token;
    if (report.bad_cells++ == 0) {
      uint64_t k = 0;
      while (got[k] == want[k]) ++k;
      char hex[64];
      std::snprintf(hex, sizeof hex, "holds 0x%02x, expected 0x%02x", got[k], want[k]);
      report.first_error = "tensor '" + layout.tensors[v.tensor].name + "' offset " + std::to_string(v.offset + k) +
                           " (group '" + v.group + "' layer '" + v.layer_name + "' component '" + v.component_name +
                           "' position " +
                           (v.position == kFinalState ? std::string("final-state") : std::to_string(v.position)) +
                           " head " + std::to_string(v.head) + " byte " + std::to_string(k) + ") " + hex;
    }
  }));
  return report;
}

}  // namespace kvbridge

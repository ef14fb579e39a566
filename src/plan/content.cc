// Deterministic KV content: see kvbridge/content.h.
#include "kvbridge/content.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <functional>
#include <span>
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

using plan_internal::kFinalState;

// Writes the pattern of one cell into `out` (`streaming`: bypassing the
// caches where it can; the caller fences): a Weyl sequence of words from
// the cell's seed (its first word, mixed from its coordinate and the
// request seed by walk()), so that every word of a cell differs, every cell
// starts elsewhere, and the loop is a vectorisable add (the demo's prefill
// writes every KV byte, its decode checks every one).
constexpr uint64_t kWeyl = 0x9e3779b97f4a7c15ull;
inline void pattern(uint64_t seed, uint64_t n, uint8_t* out, bool streaming = false) {
  uint64_t w = seed;
  uint64_t k = 0;
#if defined(__SSE2__)
  // Whole 16-byte words with non-temporal stores: a request's KV is far
  // larger than the caches, so the lines are not read before being written
  // (half the memory traffic; fill_request() fences when done).
  // A whole cache line (four stores) per iteration: in a stand-alone loop
  // on the development host, one store per iteration wrote 512 MiB in 40 ms
  // against 24.
  if (streaming && (reinterpret_cast<uintptr_t>(out) & 15) == 0 && n >= 64) {
    __m128i v0 = _mm_set_epi64x(static_cast<long long>(w + kWeyl), static_cast<long long>(w));
    const __m128i step = _mm_set1_epi64x(static_cast<long long>(2 * kWeyl));
    for (; k + 64 <= n; k += 64, w += 8 * kWeyl) {
      const __m128i v1 = _mm_add_epi64(v0, step);
      const __m128i v2 = _mm_add_epi64(v1, step);
      const __m128i v3 = _mm_add_epi64(v2, step);
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + k), v0);
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + k + 16), v1);
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + k + 32), v2);
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + k + 48), v3);
      v0 = _mm_add_epi64(v3, step);
    }
    for (; k + 16 <= n; k += 16, w += 2 * kWeyl) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + k), v0);
      v0 = _mm_add_epi64(v0, step);
    }
  }
#endif
  for (; k + 8 <= n; k += 8, w += kWeyl) std::memcpy(out + k, &w, 8);
  if (k < n) std::memcpy(out + k, &w, n - k);
}

// True when `got` holds the pattern of `seed` (pattern() without a buffer).
inline bool matches(uint64_t seed, uint64_t n, const uint8_t* got) {
  uint64_t w = seed, diff = 0;
  uint64_t k = 0;
  for (; k + 8 <= n; k += 8, w += kWeyl) {
    uint64_t g;
    std::memcpy(&g, got + k, 8);
    diff |= g ^ w;
  }
  if (k < n) return diff == 0 && std::memcmp(got + k, &w, n - k) == 0;
  return diff == 0;
}

struct CellVisit {
  size_t tensor;
  uint64_t offset, bytes, token, seed;  // seed: the cell's first word (of its coordinate and the request seed)
  const char* group;
  const char* layer_name;
  const char* component_name;
  size_t layer, component;
  uint64_t position, head;
};

// Per (layer, component) of a group: what every cell of it shares.
struct ComponentWalk {
  const Component* comp = nullptr;
  size_t tensor = 0, layer = 0, component = 0;
  bool heads_outer = false;  // one head axis holds every head, outside every position axis
  bool gaps = false;         // its cells leave room between them (for another component's)
  // Per local head h: where its cell lies from head 0's (an offset is a sum
  // of one term per axis, so this holds at every block and position), its
  // number in the model, and its cells' seed before their position,
  // mix(mix(mix(mix(mix(group) ^ layer) ^ component) ^ global head) ^
  // request seed). A cell's seed is then one mix of that and its position:
  // the per-cell walk adds and mixes once, it does not call cell_offset()
  // (fill_request() at memcpy's speed).
  std::vector<uint64_t> head_delta, head_global, head_seed;
};

// Where one position of a group lives on the walked side.
struct PositionWalk {
  uint64_t semantic, token, block, in_block;
};

template <typename Fn>
Status walk(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token, uint64_t content_seed,
            Fn&& fn) {
  std::vector<ComponentWalk> comps;
  std::vector<PositionWalk> positions;
  std::vector<uint64_t> head0;  // per (component, position) of a run: the offset at head 0
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
    comps.clear();
    for (size_t l = 0; l < g.layers.size(); ++l) {
      for (size_t c = 0; c < g.layers[l].components.size(); ++c) {
        const Component& comp = g.layers[l].components[c];
        if (comp.empty()) continue;
        ComponentWalk w;
        w.comp = &comp;
        w.tensor = static_cast<size_t>(layout.find_tensor(comp.tensor) - layout.tensors.data());
        w.layer = l;
        w.component = c;
        const uint64_t seed = mix(mix(mix(gseed) ^ l) ^ c);
        int head_axes = 0;
        uint64_t head_stride = 0, position_stride = ~uint64_t{0}, inner_stride = ~uint64_t{0};
        for (const Axis& a : comp.axes) {
          if (a.kind == AxisKind::kPosition) position_stride = std::min(position_stride, a.stride);
          if ((a.kind == AxisKind::kPosition || a.kind == AxisKind::kHead) && a.size > 1) {
            inner_stride = std::min(inner_stride, a.stride);
          }
          if (a.kind != AxisKind::kHead) continue;
          ++head_axes;
          if (comp.local_heads() <= a.size) head_stride = a.stride;
        }
        if (head_axes != 1) head_stride = 0;
        w.heads_outer = head_stride != 0 && head_stride > position_stride && position_stride != ~uint64_t{0};
        w.gaps = inner_stride != ~uint64_t{0} && inner_stride > comp.cell_bytes;
        for (uint64_t h = 0; h < comp.local_heads(); ++h) {
          uint64_t delta = 0;
          for (const Axis& a : comp.axes) {
            if (a.kind != AxisKind::kHead) continue;
            if (h >= a.size) {
              return Status::out_of_range("component '" + comp.name + "': head index " + std::to_string(h) +
                                          " is past the axis size " + std::to_string(a.size));
            }
            delta += h * a.stride;
          }
          if (h > 0 && head_axes == 0) {
            return Status::out_of_range("component '" + comp.name + "' is replicated and has no head " +
                                        std::to_string(h));
          }
          w.head_delta.push_back(delta);
          w.head_global.push_back(comp.heads ? comp.heads->first + h : 0);
          w.head_seed.push_back(mix(mix(seed ^ w.head_global.back()) ^ content_seed));
        }
        comps.push_back(std::move(w));
      }
    }
    if (comps.empty()) continue;  // e.g. a layout cut to one layer of another group
    // The positions first (where each lives), then a layer at a time over
    // them.
    positions.clear();
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
      positions.push_back({semantic, token, block, in_block});
    }
    // A layer at a time, a run of positions in one block at a time. When
    // the layer's components interleave (k and v of a token side by side)
    // they are visited innermost, so that the walk goes in address order:
    // writing one component after the other touches every other cell, which
    // made the non-temporal fill 3.5-9x slower (plan_bench BM_Content).
    // Otherwise (a state's parts one after the other) a component at a time.
    // Heads outermost when the head axis is outside the position axes (a
    // head's positions are then contiguous).
    for (size_t first = 0; first < comps.size();) {
      size_t last = first + 1;
      while (last < comps.size() && comps[last].layer == comps[first].layer) ++last;
      const std::span<const ComponentWalk> layer(comps.data() + first, last - first);
      uint64_t heads = 0;
      bool heads_outer = true, interleaved = false;
      for (const ComponentWalk& w : layer) {
        heads = std::max(heads, w.comp->local_heads());
        heads_outer = heads_outer && w.heads_outer;
        interleaved = interleaved || w.gaps;
      }
      for (size_t i = 0; i < positions.size();) {
        size_t j = i + 1;
        while (j < positions.size() && positions[j].block == positions[i].block) ++j;
        const size_t n = j - i;
        head0.resize(n * layer.size());
        for (size_t c = 0; c < layer.size(); ++c) {
          for (size_t k = 0; k < n; ++k) {
            const PositionWalk& q = positions[i + k];
            KVB_ASSIGN_OR_RETURN(head0[c * n + k], cell_offset(*layer[c].comp, {q.block, 0, q.in_block}));
          }
        }
        auto cell = [&](size_t c, size_t k, uint64_t h) {
          const ComponentWalk& w = layer[c];
          if (h >= w.head_delta.size()) return;
          const PositionWalk& q = positions[i + k];
          const uint64_t global = w.head_global[h];
          fn(CellVisit{w.tensor, head0[c * n + k] + w.head_delta[h], w.comp->cell_bytes, q.token,
                       mix(w.head_seed[h] ^ q.semantic), g.name.c_str(), g.layers[w.layer].name.c_str(),
                       w.comp->name.c_str(), w.layer, w.component, q.semantic, global});
        };
        if (!interleaved) {
          for (size_t c = 0; c < layer.size(); ++c) {
            for (uint64_t outer = 0; outer < (layer[c].heads_outer ? heads : n); ++outer) {
              for (uint64_t inner = 0; inner < (layer[c].heads_outer ? n : heads); ++inner) {
                if (layer[c].heads_outer) {
                  cell(c, inner, outer);
                } else {
                  cell(c, outer, inner);
                }
              }
            }
          }
        } else if (heads_outer) {
          for (uint64_t h = 0; h < heads; ++h) {
            for (size_t k = 0; k < n; ++k) {
              for (size_t c = 0; c < layer.size(); ++c) cell(c, k, h);
            }
          }
        } else {
          for (size_t k = 0; k < n; ++k) {
            for (uint64_t h = 0; h < heads; ++h) {
              for (size_t c = 0; c < layer.size(); ++c) cell(c, k, h);
            }
          }
        }
        i = j;
      }
      first = last;
    }
  }
  return Status();
}

}  // namespace

Status for_each_cell(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token,
                     const std::function<void(size_t, uint64_t, uint64_t, uint64_t)>& cell) {
  return walk(layout, request, side, first_token, 0,
              [&](const CellVisit& v) { cell(v.tensor, v.offset, v.bytes, v.token); });
}

Status fill_request(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token, uint64_t seed,
                    TensorMemory tensors) {
  KVB_RETURN_IF_ERROR(check_memory(layout, tensors));
  Status s = walk(layout, request, side, first_token, seed,
                  [&](const CellVisit& v) { pattern(v.seed, v.bytes, tensors[v.tensor].data() + v.offset, true); });
#if defined(__SSE2__)
  _mm_sfence();  // the non-temporal stores are visible before this returns
#endif
  return s;
}

Result<ContentReport> check_request(const Layout& layout, const Request& request, RequestSide side,
                                    uint64_t first_token, uint64_t seed, TensorMemory tensors) {
  KVB_RETURN_IF_ERROR(check_memory(layout, tensors));
  ContentReport report;
  std::vector<uint8_t> want;
  KVB_RETURN_IF_ERROR(walk(layout, request, side, first_token, seed, [&](const CellVisit& v) {
    const uint8_t* got = tensors[v.tensor].data() + v.offset;
    ++report.cells;
    report.bytes += v.bytes;
    if (matches(v.seed, v.bytes, got)) return;
    want.resize(v.bytes);
    pattern(v.seed, v.bytes, want.data());
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

// validate(): every rule of docs/formats/layout.md, with overflow-safe
// arithmetic, and messages that name the group, layer and component.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "common/checked.h"
#include "common/text.h"
#include "kvbridge/layout.h"
#include "layout/memory_name.h"

namespace kvbridge {

bool layout_internal::valid_memory(const std::string& m) {
  if (m == "host") return true;
  if (m.rfind("cuda:", 0) != 0 || m.size() == 5 || m.size() > 10) return false;
  return std::all_of(m.begin() + 5, m.end(), [](char c) { return c >= '0' && c <= '9'; });
}

namespace {

using layout_internal::valid_memory;

// Cells of one component are enumerated exactly only up to this many, when
// the cheap nesting proof below fails.
constexpr uint64_t kMaxExactOverlapCells = uint64_t{1} << 22;

// Well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), so that every valid layout has a JSON form.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

Status check_name(std::string_view what, const std::string& name) {
  if (name.empty()) return Status::invalid_argument(std::string(what) + " name is empty");
  if (!valid_utf8(name)) return Status::invalid_argument(std::string(what) + " name is not valid UTF-8");
  if (name.size() > kMaxNameBytes) {
    return Status::resource_exhausted(std::string(what) + " name is longer than " + std::to_string(kMaxNameBytes) +
                                      " bytes");
  }
  return Status();
}

// Proves that no two cells overlap. Cheap case: sorted by stride, every axis
// steps past everything the smaller axes span (the usual nested layouts, with
// any padding). Otherwise the cell starts are enumerated and sorted.
Status check_no_overlap(const Component& c) {
  std::vector<Axis> axes;
  for (const Axis& a : c.axes) {
    if (a.size > 1) axes.push_back(a);
  }
  std::sort(axes.begin(), axes.end(), [](const Axis& a, const Axis& b) { return a.stride < b.stride; });
  uint64_t extent = c.cell_bytes;
  bool nested = true;
  for (const Axis& a : axes) {
    if (a.stride < extent) {
      nested = false;
      break;
    }
    extent = a.stride * (a.size - 1) + extent;  // bounded by the tensor check
  }
  if (nested) return Status();

  uint64_t cells = 1;
  for (const Axis& a : axes) {
    if (!checked_mul(cells, a.size, &cells) || cells > kMaxExactOverlapCells) {
      return Status::invalid_argument(
          "cells overlap or interleave (strides are not nested) and there are too many to check "
          "exactly (limit " +
          std::to_string(kMaxExactOverlapCells) + ")");
    }
  }
  std::vector<uint64_t> starts{0};
  for (const Axis& a : axes) {
    std::vector<uint64_t> next;
    next.reserve(starts.size() * a.size);
    for (uint64_t s : starts) {
      for (uint64_t i = 0; i < a.size; ++i) next.push_back(s + i * a.stride);
    }
    starts.swap(next);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i) {
    if (starts[i] - starts[i - 1] < c.cell_bytes) {
      return Status::out_of_range("cells overlap: the cells at offsets " + std::to_string(c.offset + starts[i - 1]) +
                                  " and " + std::to_string(c.offset + starts[i]) + " share bytes (cell_bytes " +
                                  std::to_string(c.cell_bytes) + ")");
    }
  }
  return Status();
}

Status check_heads(const HeadMap& h) {
  if (h.total == 0 || h.total > kMaxHeads) {
    return Status::invalid_argument("heads.total " + std::to_string(h.total) + " must be in [1, " +
                                    std::to_string(kMaxHeads) + "]");
  }
  if (h.count > h.total || h.first >= h.total || uint64_t{h.first} + h.count > h.total) {
    return Status::invalid_argument("heads {first " + std::to_string(h.first) + ", count " + std::to_string(h.count) +
                                    "} do not fit in heads.total " + std::to_string(h.total));
  }
  return Status();
}

// A component of a layer this rank does not hold: its identity only.
Status validate_unheld_component(const Component& c) {
  KVB_RETURN_IF_ERROR(check_name("component", c.name));
  if (c.cell_bytes > kMaxCellBytes) {
    return Status::resource_exhausted("cell_bytes " + std::to_string(c.cell_bytes) + " exceeds " +
                                      std::to_string(kMaxCellBytes));
  }
  if (!c.tensor.empty() || c.offset != 0 || !c.axes.empty()) {
    return Status::invalid_argument("is in a layer this rank does not hold, so it has no tensor, offset or axes");
  }
  return c.heads ? check_heads(*c.heads) : Status();
}

Status validate_component(const Layout& layout, const Group& g, const Component& c) {
  KVB_RETURN_IF_ERROR(check_name("component", c.name));
  const Tensor* t = layout.find_tensor(c.tensor);
  if (t == nullptr) return Status::not_found("tensor " + q(c.tensor) + " is not declared in tensors");
  if (c.cell_bytes > kMaxCellBytes) {
    return Status::resource_exhausted("cell_bytes " + std::to_string(c.cell_bytes) + " exceeds " +
                                      std::to_string(kMaxCellBytes));
  }
  if (c.offset > t->bytes) {
    return Status::out_of_range("offset " + std::to_string(c.offset) + " is past the end of tensor " + q(t->name) +
                                " (" + std::to_string(t->bytes) + " bytes)");
  }
  int blocks = 0, heads = 0;
  size_t positions = 0;
  uint64_t position_product = 1;
  for (const Axis& a : c.axes) {
    if (a.stride > kMaxTensorBytes) {
      return Status::resource_exhausted(std::string(axis_kind_name(a.kind)) + " axis stride " +
                                        std::to_string(a.stride) + " exceeds " + std::to_string(kMaxTensorBytes));
    }
    switch (a.kind) {
      case AxisKind::kBlock:
        ++blocks;
        if (a.size != g.num_blocks) {
          return Status::invalid_argument("block axis size " + std::to_string(a.size) +
                                          " differs from the group's num_blocks " + std::to_string(g.num_blocks));
        }
        break;
      case AxisKind::kHead:
        ++heads;
        if (c.heads && a.size != c.heads->count) {
          return Status::invalid_argument("head axis size " + std::to_string(a.size) + " differs from heads.count " +
                                          std::to_string(c.heads->count));
        }
        break;
      case AxisKind::kPosition:
        ++positions;
        if (!checked_mul(position_product, a.size, &position_product)) {
          return Status::resource_exhausted("position axes' sizes overflow");
        }
        break;
    }
  }
  if (blocks != 1) {
    return Status::invalid_argument("has " + std::to_string(blocks) + " block axes; exactly one is required");
  }
  if (heads > 1) return Status::invalid_argument("has " + std::to_string(heads) + " head axes; at most one is allowed");
  if (heads == 1 && !c.heads) return Status::invalid_argument("has a head axis but no heads map");
  if (heads == 0 && c.heads) {
    return Status::invalid_argument("has a heads map but no head axis (a replicated component has neither)");
  }
  if (c.heads) KVB_RETURN_IF_ERROR(check_heads(*c.heads));
  if (positions > kMaxPositionAxes) {
    return Status::invalid_argument("has " + std::to_string(positions) + " position axes; at most " +
                                    std::to_string(kMaxPositionAxes) + " are allowed");
  }
  if (g.kind == GroupKind::kState) {
    if (positions != 0) {
      return Status::invalid_argument("a state group's block holds one state; remove the position axes");
    }
  } else if (position_product != g.positions_per_block()) {
    return Status::invalid_argument(
        "position axes hold " + std::to_string(position_product) +
        " positions per block, but block_tokens / tokens_per_state = " + std::to_string(g.block_tokens) + " / " +
        std::to_string(g.tokens_per_state) + " = " + std::to_string(g.positions_per_block()));
  }
  if (c.empty()) return Status();  // Moves nothing; it addresses no byte.

  // The last byte of the last cell must lie inside the tensor.
  uint64_t end = c.offset;
  for (const Axis& a : c.axes) {
    if (!checked_mul_add(a.size - 1, a.stride, end, &end)) {
      return Status::out_of_range("cell addresses overflow 64 bits");
    }
  }
  if (!checked_add(end, c.cell_bytes, &end) || end > t->bytes) {
    return Status::out_of_range("cells end at byte " + std::to_string(end) + ", past the end of tensor " + q(t->name) +
                                " (" + std::to_string(t->bytes) + " bytes)");
  }
  return check_no_overlap(c);
}

Status validate_group(const Layout& layout, const Group& g) {
  KVB_RETURN_IF_ERROR(check_name("group", g.name));
  if (g.block_tokens == 0 || g.block_tokens > kMaxBlockTokens) {
    return Status::invalid_argument("block_tokens " + std::to_string(g.block_tokens) + " must be in [1, " +
                                    std::to_string(kMaxBlockTokens) + "]");
  }
  if (g.tokens_per_state == 0 || g.tokens_per_state > g.block_tokens) {
    return Status::invalid_argument("tokens_per_state " + std::to_string(g.tokens_per_state) + " must be in [1, " +
                                    "block_tokens " + std::to_string(g.block_tokens) + "]");
  }
  if (g.kind != GroupKind::kState && g.block_tokens % g.tokens_per_state != 0) {
    return Status::invalid_argument("block_tokens " + std::to_string(g.block_tokens) +
                                    " is not a multiple of tokens_per_state " + std::to_string(g.tokens_per_state));
  }
  if (g.kind == GroupKind::kSlidingWindow) {
    if (!g.window_tokens || *g.window_tokens == 0) {
      return Status::invalid_argument("a sliding_window group needs window_tokens >= 1");
    }
  } else if (g.window_tokens) {
    return Status::invalid_argument("window_tokens is set but the group's kind is " +
                                    std::string(group_kind_name(g.kind)) + ", not sliding_window");
  }
  if (g.context.size == 0 || g.context.size > kMaxContextShards) {
    return Status::invalid_argument("context.size " + std::to_string(g.context.size) + " must be in [1, " +
                                    std::to_string(kMaxContextShards) + "]");
  }
  if (g.context.rank >= g.context.size) {
    return Status::invalid_argument("context.rank " + std::to_string(g.context.rank) + " must be below context.size " +
                                    std::to_string(g.context.size));
  }
  if (g.context.interleave == 0 || g.context.interleave > kMaxBlockTokens) {
    return Status::invalid_argument("context.interleave " + std::to_string(g.context.interleave) + " must be in [1, " +
                                    std::to_string(kMaxBlockTokens) + "]");
  }
  // One shard holds every position in order; an interleave there would mean
  // nothing, and the JSON form (which leaves an unsharded context out) could
  // not carry it.
  if (!g.context.sharded() && g.context.interleave != 1) {
    return Status::invalid_argument("context.interleave " + std::to_string(g.context.interleave) +
                                    " needs context.size above 1 (one shard holds every position in order); "
                                    "leave the interleave at 1 or the context out");
  }
  if (g.context.sharded() && g.kind != GroupKind::kAttention && g.kind != GroupKind::kSlidingWindow) {
    return Status::invalid_argument("a " + std::string(group_kind_name(g.kind)) +
                                    " group cannot be context-sharded (only attention and sliding_window groups "
                                    "have positions to deal over shards)");
  }
  if (g.kind == GroupKind::kScratch && g.prefix_cacheable) {
    return Status::invalid_argument(
        "a scratch group is per-request and never prefix data; set prefix_cacheable to false");
  }
  if (g.num_blocks == 0 || g.num_blocks > kMaxNumBlocks) {
    return Status::invalid_argument("num_blocks " + std::to_string(g.num_blocks) + " must be in [1, " +
                                    std::to_string(kMaxNumBlocks) + "]");
  }
  if (g.layers.empty()) return Status::invalid_argument("has no layers");
  if (g.layers.size() > kMaxLayersPerGroup) {
    return Status::resource_exhausted("has " + std::to_string(g.layers.size()) + " layers; at most " +
                                      std::to_string(kMaxLayersPerGroup) + " are allowed");
  }
  std::set<std::string_view> layer_names;
  for (const Layer& l : g.layers) {
    std::string where = "layer " + q(l.name);
    KVB_RETURN_IF_ERROR(check_name("layer", l.name).with_context(where));
    if (!layer_names.insert(l.name).second) return Status::already_exists(where + " appears twice");
    if (l.components.empty()) return Status::invalid_argument(where + " has no components");
    if (l.components.size() > kMaxComponentsPerLayer) {
      return Status::resource_exhausted(where + " has more than " + std::to_string(kMaxComponentsPerLayer) +
                                        " components");
    }
    if (!l.held && layout.pp_size == 1) {
      return Status::invalid_argument(where +
                                      " is not held, but pp_size is 1: a rank without pipeline stages "
                                      "holds every layer");
    }
    std::set<std::string_view> component_names;
    for (const Component& c : l.components) {
      std::string cwhere = where + " component " + q(c.name);
      if (!component_names.insert(c.name).second) return Status::already_exists(cwhere + " appears twice");
      KVB_RETURN_IF_ERROR(
          (l.held ? validate_component(layout, g, c) : validate_unheld_component(c)).with_context(cwhere));
    }
  }
  return Status();
}

}  // namespace

Status validate(const Layout& layout) {
  if (layout.model.empty()) return Status::invalid_argument("model is empty");
  if (layout.dtype.empty()) return Status::invalid_argument("dtype is empty");
  KVB_RETURN_IF_ERROR(check_name("model", layout.model));
  KVB_RETURN_IF_ERROR(check_name("dtype", layout.dtype));
  if (layout.tp_size == 0 || layout.tp_size > kMaxTpSize) {
    return Status::invalid_argument("tp_size " + std::to_string(layout.tp_size) + " must be in [1, " +
                                    std::to_string(kMaxTpSize) + "]");
  }
  if (layout.tp_rank >= layout.tp_size) {
    return Status::invalid_argument("tp_rank " + std::to_string(layout.tp_rank) + " must be below tp_size " +
                                    std::to_string(layout.tp_size));
  }
  if (layout.pp_size == 0 || layout.pp_size > kMaxPpSize) {
    return Status::invalid_argument("pp_size " + std::to_string(layout.pp_size) + " must be in [1, " +
                                    std::to_string(kMaxPpSize) + "]");
  }
  if (layout.pp_rank >= layout.pp_size) {
    return Status::invalid_argument("pp_rank " + std::to_string(layout.pp_rank) + " must be below pp_size " +
                                    std::to_string(layout.pp_size));
  }
  if (layout.tensors.size() > kMaxTensors) {
    return Status::resource_exhausted("more than " + std::to_string(kMaxTensors) + " tensors");
  }
  std::set<std::string_view> tensor_names;
  for (const Tensor& t : layout.tensors) {
    std::string where = "tensor " + q(t.name);
    KVB_RETURN_IF_ERROR(check_name("tensor", t.name));
    if (!tensor_names.insert(t.name).second) return Status::already_exists(where + " is declared twice");
    if (t.bytes > kMaxTensorBytes) {
      return Status::resource_exhausted(where + ": bytes " + std::to_string(t.bytes) + " exceeds " +
                                        std::to_string(kMaxTensorBytes));
    }
    if (!valid_memory(t.memory)) {
      return Status::invalid_argument(where + ": memory " + q(t.memory) + " is neither 'host' nor 'cuda:N'");
    }
  }
  if (layout.groups.empty()) return Status::invalid_argument("the layout has no groups");
  if (layout.groups.size() > kMaxGroups) {
    return Status::resource_exhausted("more than " + std::to_string(kMaxGroups) + " groups");
  }
  std::set<std::string_view> group_names;
  for (const Group& g : layout.groups) {
    std::string where = "group " + q(g.name);
    if (!group_names.insert(g.name).second) return Status::already_exists(where + " is declared twice");
    KVB_RETURN_IF_ERROR(validate_group(layout, g).with_context(where));
  }
  const bool holds_any = std::any_of(layout.groups.begin(), layout.groups.end(), [](const Group& g) {
    return std::any_of(g.layers.begin(), g.layers.end(), [](const Layer& l) { return l.held; });
  });
  if (!holds_any) return Status::invalid_argument("the layout holds no layer (every layer is marked not held)");
  return Status();
}

}  // namespace kvbridge

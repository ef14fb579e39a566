// Names of kinds, lookups, and the address arithmetic of the layout model.
#include "kvbridge/layout.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>

namespace kvbridge {

std::string_view group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kAttention:
      return "attention";
    case GroupKind::kSlidingWindow:
      return "sliding_window";
    case GroupKind::kState:
      return "state";
    case GroupKind::kScratch:
      return "scratch";
  }
  return "unknown";
}

std::optional<GroupKind> parse_group_kind(std::string_view name) {
  for (GroupKind k : {GroupKind::kAttention, GroupKind::kSlidingWindow, GroupKind::kState, GroupKind::kScratch}) {
    if (group_kind_name(k) == name) return k;
  }
  return std::nullopt;
}

std::string_view axis_kind_name(AxisKind kind) {
  switch (kind) {
    case AxisKind::kBlock:
      return "block";
    case AxisKind::kHead:
      return "head";
    case AxisKind::kPosition:
      return "position";
  }
  return "unknown";
}

std::optional<AxisKind> parse_axis_kind(std::string_view name) {
  for (AxisKind k : {AxisKind::kBlock, AxisKind::kHead, AxisKind::kPosition}) {
    if (axis_kind_name(k) == name) return k;
  }
  return std::nullopt;
}

uint64_t Component::positions_per_block() const {
  uint64_t n = 1;
  for (const Axis& a : axes) {
    if (a.kind == AxisKind::kPosition) n *= a.size;
  }
  return n;
}

bool Component::empty() const {
  if (cell_bytes == 0 || axes.empty()) return true;
  if (heads && heads->count == 0) return true;
  for (const Axis& a : axes) {
    if (a.size == 0) return true;
  }
  return false;
}

uint64_t Group::positions_per_block() const {
  if (kind == GroupKind::kState) return 1;
  return tokens_per_state == 0 ? 0 : block_tokens / tokens_per_state;
}

BlockSlot Group::slot_of_token(uint64_t token) const {
  if (!context.sharded()) return {token / block_tokens, token % block_tokens};
  // By position on the holding shard, then back to a token offset.
  const uint64_t tps = tokens_per_state, ppb = positions_per_block();
  const uint64_t q = context.local_of(token / tps);
  return {q / ppb, q % ppb * tps + token % tps};
}

uint64_t Group::entries_for_tokens(uint64_t num_tokens) const {
  if (!context.sharded()) return num_tokens / block_tokens + (num_tokens % block_tokens != 0);
  const uint64_t tps = tokens_per_state, ppb = positions_per_block();
  const uint64_t q = context.count(num_tokens / tps + (num_tokens % tps != 0), 0);
  return q / ppb + (q % ppb != 0);
}

const Tensor* Layout::find_tensor(std::string_view name) const {
  for (const Tensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const Group* Layout::find_group(std::string_view name) const {
  for (const Group& g : groups) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

Layout keep_layers(Layout layout, const std::set<std::string, std::less<>>& keep) {
  for (Group& g : layout.groups) {
    for (Layer& l : g.layers) {
      if (keep.count(l.name) != 0) continue;
      for (Component& c : l.components) c.cell_bytes = 0;
    }
  }
  return layout;
}

namespace {

// The number a layer name ends with ("layers.12": 12), if any.
std::optional<uint64_t> trailing_number(std::string_view name) {
  size_t i = name.size();
  while (i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9') --i;
  if (i == name.size() || name.size() - i > 18) return std::nullopt;
  uint64_t v = 0;
  for (size_t k = i; k < name.size(); ++k) v = v * 10 + static_cast<uint64_t>(name[k] - '0');
  return v;
}

}  // namespace

std::vector<std::string> layer_order(const Layout& layout) {
  std::vector<std::string> names;
  for (const Group& g : layout.groups) {
    for (const Layer& l : g.layers) names.push_back(l.name);
  }
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    const std::optional<uint64_t> na = trailing_number(a), nb = trailing_number(b);
    if (na.has_value() != nb.has_value()) return na.has_value();
    if (na && *na != *nb) return *na < *nb;
    return a < b;
  });
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

std::set<std::string, std::less<>> pp_stage_layers(const std::vector<std::string>& order, uint32_t pp_size,
                                                   uint32_t pp_rank) {
  std::vector<size_t> sizes(pp_size, order.size() / pp_size);
  const size_t remaining = order.size() % pp_size;
  for (size_t i = 2; i < remaining + 2; ++i) ++sizes[pp_size - i];
  size_t first = 0;
  for (uint32_t s = 0; s < pp_rank; ++s) first += sizes[s];
  return {order.begin() + static_cast<std::ptrdiff_t>(first),
          order.begin() + static_cast<std::ptrdiff_t>(first + sizes[pp_rank])};
}

Layout as_pp_stage(Layout layout, uint32_t pp_size, uint32_t pp_rank, const std::set<std::string, std::less<>>& held) {
  layout.pp_size = pp_size;
  layout.pp_rank = pp_rank;
  for (Group& g : layout.groups) {
    for (Layer& l : g.layers) {
      if (held.count(l.name) != 0) continue;
      l.held = false;
      for (Component& c : l.components) {
        c.tensor.clear();
        c.offset = 0;
        c.axes.clear();
      }
    }
  }
  return layout;
}

bool has_overlay(const Layout& layout) {
  std::map<std::string_view, size_t> owner;  // tensor name -> first group using it
  for (size_t gi = 0; gi < layout.groups.size(); ++gi) {
    for (const Layer& layer : layout.groups[gi].layers) {
      if (!layer.held) continue;
      for (const Component& c : layer.components) {
        auto [it, fresh] = owner.emplace(c.tensor, gi);
        if (!fresh && it->second != gi) return true;
      }
    }
  }
  return false;
}

Status check_memory(const Layout& layout, TensorMemory memory) {
  if (memory.size() != layout.tensors.size()) {
    return Status::invalid_argument("memory for " + std::to_string(memory.size()) + " tensors given, the layout has " +
                                    std::to_string(layout.tensors.size()));
  }
  for (size_t t = 0; t < memory.size(); ++t) {
    if (memory[t].size() != layout.tensors[t].bytes) {
      return Status::invalid_argument("memory for tensor '" + layout.tensors[t].name + "' is " +
                                      std::to_string(memory[t].size()) + " bytes, the layout says " +
                                      std::to_string(layout.tensors[t].bytes));
    }
  }
  return Status();
}

std::optional<uint64_t> axis_stride(const Component& component, AxisKind kind) {
  for (const Axis& a : component.axes) {
    if (a.kind == kind) return a.stride;
  }
  return std::nullopt;
}

namespace {

bool span_before(const TensorSpan& x, const TensorSpan& y) {
  return std::tie(x.tensor, x.offset) < std::tie(y.tensor, y.offset);
}

// Merges sorted spans where they touch.
void merge_sorted(std::vector<TensorSpan>& v, size_t from = 0) {
  size_t n = from;
  for (size_t i = from; i < v.size(); ++i) {
    const TensorSpan s = v[i];
    if (n > from && v[n - 1].tensor == s.tensor && s.offset <= v[n - 1].offset + v[n - 1].bytes) {
      v[n - 1].bytes = std::max(v[n - 1].bytes, s.offset + s.bytes - v[n - 1].offset);
    } else {
      v[n++] = s;
    }
  }
  v.resize(n);
}

// The ids of `blocks` at or above 0, sorted, each once; kOutOfRange naming
// the group for one not below num_blocks.
Result<std::vector<uint64_t>> block_ids(const Group& group, std::span<const int64_t> blocks) {
  std::vector<uint64_t> ids;
  ids.reserve(blocks.size());
  for (int64_t b : blocks) {
    if (b < 0) continue;
    if (static_cast<uint64_t>(b) >= group.num_blocks) {
      return Status::out_of_range("group '" + group.name + "': block " + std::to_string(b) + " is not below " +
                                  std::to_string(group.num_blocks) + " blocks");
    }
    ids.push_back(static_cast<uint64_t>(b));
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

// A block's bytes in one tensor are the same pattern for every block,
// moved by the block stride: per (tensor, block stride), the runs of block
// 0 of every component that shares them (k and v interleaved per token
// make one run together, where each alone is a run per token), sorted and
// merged.
std::map<std::pair<uint32_t, uint64_t>, std::vector<TensorSpan>> block_patterns(const Layout& layout,
                                                                                const Group& group) {
  std::map<std::pair<uint32_t, uint64_t>, std::vector<TensorSpan>> patterns;
  for (const Layer& layer : group.layers) {
    if (!layer.held) continue;
    for (const Component& c : layer.components) {
      if (c.empty()) continue;
      uint32_t tensor = 0;
      while (tensor < layout.tensors.size() && layout.tensors[tensor].name != c.tensor) ++tensor;
      // One run of `run` bytes per index of the walked axes: the axes that
      // continue the cell densely, innermost first, join the run; the rest
      // (and any after a gap) are walked.
      uint64_t block_stride = 0, run = c.cell_bytes;
      std::vector<Axis> rest;
      for (const Axis& a : c.axes) {
        if (a.kind == AxisKind::kBlock) {
          block_stride = a.stride;
        } else if (a.size > 1) {
          rest.push_back(a);
        }
      }
      std::sort(rest.begin(), rest.end(), [](const Axis& x, const Axis& y) { return x.stride < y.stride; });
      size_t joined = 0;
      while (joined < rest.size() && rest[joined].stride == run) run *= rest[joined++].size;
      rest.erase(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(joined));
      std::vector<TensorSpan>& pattern = patterns[{tensor, block_stride}];
      std::vector<uint64_t> index(rest.size(), 0);
      while (true) {
        uint64_t at = c.offset;
        for (size_t i = 0; i < rest.size(); ++i) at += index[i] * rest[i].stride;
        pattern.push_back({tensor, at, run});
        size_t i = 0;
        while (i < rest.size() && ++index[i] == rest[i].size) index[i++] = 0;
        if (i == rest.size()) break;
      }
    }
  }
  for (auto& [key, pattern] : patterns) {
    std::sort(pattern.begin(), pattern.end(), span_before);
    merge_sorted(pattern);
  }
  return patterns;
}

// Appends `pattern` laid out at each of `ids` (sorted) by `stride`, sorted
// and merged.
void lay_out(const std::vector<TensorSpan>& pattern, uint64_t stride, const std::vector<uint64_t>& ids,
             std::vector<TensorSpan>& out) {
  const size_t start = out.size();
  for (uint64_t b : ids) {
    for (const TensorSpan& p : pattern) out.push_back({p.tensor, p.offset + b * stride, p.bytes});
  }
  // In id order the copies come out sorted when they do not reach past the
  // next block.
  const auto first = out.begin() + static_cast<std::ptrdiff_t>(start);
  if (!std::is_sorted(first, out.end(), span_before)) std::sort(first, out.end(), span_before);
}

}  // namespace

Result<std::vector<TensorSpan>> block_spans(const Layout& layout, const Group& group, std::span<const int64_t> blocks) {
  KVB_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, block_ids(group, blocks));
  const auto patterns = block_patterns(layout, group);
  // Each pattern's sequence is sorted; the sequences are then merged, not
  // sorted (a request of 8,192 blocks of an 80-layer model is 655,360
  // runs, or 1.3 M uninterleaved).
  size_t total = 0;
  for (const auto& [key, pattern] : patterns) total += ids.size() * pattern.size();
  std::vector<TensorSpan> out;
  out.reserve(total);
  std::vector<size_t> starts;  // where each pattern's sequence starts in `out`
  for (const auto& [key, pattern] : patterns) {
    starts.push_back(out.size());
    lay_out(pattern, key.second, ids, out);
  }
  // Bottom-up merges of the sorted sequences; none when they follow each
  // other already (a tensor per layer, or one stride per tensor).
  if (!std::is_sorted(out.begin(), out.end(), span_before)) {
    starts.push_back(out.size());
    while (starts.size() > 2) {
      std::vector<size_t> next;
      for (size_t i = 0; i + 1 < starts.size(); i += 2) {
        next.push_back(starts[i]);
        if (i + 2 < starts.size()) {
          std::inplace_merge(out.begin() + static_cast<std::ptrdiff_t>(starts[i]),
                             out.begin() + static_cast<std::ptrdiff_t>(starts[i + 1]),
                             out.begin() + static_cast<std::ptrdiff_t>(starts[i + 2]), span_before);
        }
      }
      if (next.back() != out.size()) next.push_back(out.size());
      starts = std::move(next);
    }
  }
  merge_sorted(out);
  return out;
}

Result<BlockPlaces> block_places(const Layout& layout, const Group& group, std::span<const int64_t> blocks) {
  KVB_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, block_ids(group, blocks));
  const auto patterns = block_patterns(layout, group);
  // Patterns of one shape (block stride, and runs relative to the first):
  // the first laid out, the others repeats of it at their own offset.
  struct Laid {
    uint64_t first, count, base;
  };
  std::map<std::pair<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>>, Laid> shapes;
  BlockPlaces out;
  for (const auto& [key, pattern] : patterns) {
    if (pattern.empty()) continue;
    const uint64_t base = pattern.front().offset;
    std::vector<std::pair<uint64_t, uint64_t>> shape;
    shape.reserve(pattern.size());
    for (const TensorSpan& p : pattern) shape.emplace_back(p.offset - base, p.bytes);
    auto [it, made] = shapes.try_emplace({key.second, std::move(shape)}, Laid{out.spans.size(), 0, base});
    if (made) {
      lay_out(pattern, key.second, ids, out.spans);
      merge_sorted(out.spans, it->second.first);
      it->second.count = out.spans.size() - it->second.first;
    } else if (it->second.count > 0) {
      out.repeats.push_back({it->second.first, it->second.count, key.first, base - it->second.base});
    }
  }
  return out;
}

PositionAxes position_axes(const Component& component) {
  PositionAxes p;
  for (const Axis& a : component.axes) {
    if (a.kind == AxisKind::kPosition) {
      p.sizes.push_back(a.size);
      p.strides.push_back(a.stride);
    }
  }
  return p;
}

uint64_t PositionAxes::offset_of(uint64_t position) const {
  // Mixed radix, outermost digit first: peel digits from the innermost axis.
  uint64_t off = 0;
  for (size_t i = sizes.size(); i-- > 0;) {
    off += (position % sizes[i]) * strides[i];
    position /= sizes[i];
  }
  return off;
}

Result<uint64_t> cell_offset(const Component& c, const CellIndex& cell) {
  uint64_t off = c.offset;
  uint64_t rest = cell.position;
  bool saw_head = false;
  // Position digits are peeled innermost first, so walk the position axes in
  // reverse while adding block and head terms as they come.
  for (size_t i = c.axes.size(); i-- > 0;) {
    const Axis& a = c.axes[i];
    uint64_t index = 0;
    switch (a.kind) {
      case AxisKind::kBlock:
        index = cell.block;
        break;
      case AxisKind::kHead:
        index = cell.head;
        saw_head = true;
        break;
      case AxisKind::kPosition:
        if (a.size == 0) return Status::out_of_range("component '" + c.name + "' has an empty position axis");
        index = rest % a.size;
        rest /= a.size;
        break;
    }
    if (index >= a.size) {
      return Status::out_of_range("component '" + c.name + "': " + std::string(axis_kind_name(a.kind)) + " index " +
                                  std::to_string(index) + " is past the axis size " + std::to_string(a.size));
    }
    off += index * a.stride;
  }
  if (rest != 0) {
    return Status::out_of_range("component '" + c.name + "': position " + std::to_string(cell.position) +
                                " is past the " + std::to_string(c.positions_per_block()) + " positions of a block");
  }
  if (!saw_head && cell.head != 0) {
    return Status::out_of_range("component '" + c.name + "' is replicated and has no head " +
                                std::to_string(cell.head));
  }
  return off;
}

}  // namespace kvbridge

// kvbridge/layout.h: the one model of how a rank's KV cache sits in memory.
//
// A Layout describes what one rank of an engine instance holds: its tensors
// (contiguous allocations), and groups of layers that share a block table. Each
// layer has components (k, v, latent, rope, index, tail, conv, ssm, ...), and
// each component is a strided view into one tensor: the byte address of a cell
// (position, head) of block b is
//
//   tensor.base + offset + sum(index_a * stride_a)   over the component's axes,
//
// and the cell is `cell_bytes` contiguous bytes. Every other part of kvbridge
// reads geometry through this header and nothing else derives it. The JSON form
// is `kvbridge.layout/3` (docs/formats/layout.md; /1 and /2 documents are read too),
// parsed by layout_json.h.
//
// A rank of a pipeline-parallel instance holds a range of the model's layers
// (its PP stage): its layout still lists every layer of the model, so that
// its identity is the whole model's, and marks the layers it does not hold
// (Layer::held false: their components keep name, cell_bytes and heads, and
// address nothing).
//
// A rank of a context-parallel instance holds a share of a group's positions
// (Group::context): the positions are dealt over the shards in chunks, and
// the rank's block list holds its own positions only.
//
// A Layout value is plain data; validate() checks it, and the functions taking
// a Layout other than validate() require a valid one (parse_layout() returns
// only valid layouts).
//
// Thread-safety: plain values; const access from several threads is safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge {

inline constexpr std::string_view kLayoutFormat = "kvbridge.layout/3";
// The earlier versions, still read: /1 has no PP fields, /2 no context
// shards. to_json() writes the oldest version that holds the layout (/1 for
// pp_size 1 and no context shard), so that older readers keep reading it.
inline constexpr std::string_view kLayoutFormatV1 = "kvbridge.layout/1";
inline constexpr std::string_view kLayoutFormatV2 = "kvbridge.layout/2";

// Bounds on what a layout may hold, so that hostile input cannot exhaust
// memory or overflow 64-bit address arithmetic.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 56;
inline constexpr uint64_t kMaxNumBlocks = uint64_t{1} << 32;
inline constexpr uint64_t kMaxBlockTokens = uint64_t{1} << 24;
inline constexpr uint64_t kMaxCellBytes = uint64_t{1} << 32;
inline constexpr uint32_t kMaxTpSize = 1u << 16;
inline constexpr uint32_t kMaxPpSize = 1u << 10;
inline constexpr uint32_t kMaxContextShards = 1u << 10;
inline constexpr uint32_t kMaxHeads = 1u << 16;
inline constexpr size_t kMaxTensors = 1u << 16;
inline constexpr size_t kMaxGroups = 256;
inline constexpr size_t kMaxLayersPerGroup = 1u << 14;
inline constexpr size_t kMaxComponentsPerLayer = 64;
inline constexpr size_t kMaxPositionAxes = 4;
inline constexpr size_t kMaxNameBytes = 256;

enum class GroupKind : uint8_t { kAttention, kSlidingWindow, kState, kScratch };
enum class AxisKind : uint8_t { kBlock, kHead, kPosition };

// True for the kinds whose positions are tokens (or groups of
// tokens_per_state tokens): all but kState, whose one position is a state.
inline bool token_indexed(GroupKind kind) { return kind != GroupKind::kState; }
// True for the kinds of which a request holds one block whatever its
// length: a state, and a scratch ring (engines keep both in pools of a slot
// per running request where they have tensors of their own).
inline bool one_block_per_request(GroupKind kind) { return kind == GroupKind::kState || kind == GroupKind::kScratch; }

// "attention", "sliding_window", "state", "scratch".
std::string_view group_kind_name(GroupKind kind);
std::optional<GroupKind> parse_group_kind(std::string_view name);
// "block", "head", "position".
std::string_view axis_kind_name(AxisKind kind);
std::optional<AxisKind> parse_axis_kind(std::string_view name);

struct Tensor {
  std::string name;
  uint64_t bytes = 0;
  std::string memory = "host";  // "host" or "cuda:N"
  bool operator==(const Tensor&) const = default;
};

struct Axis {
  AxisKind kind = AxisKind::kBlock;
  uint64_t size = 0;
  uint64_t stride = 0;  // bytes
  bool operator==(const Axis&) const = default;
};

// Local head h of a component is global head `first + h`; `count` heads are
// held. When TP exceeds `total`, several ranks hold the same global head.
struct HeadMap {
  uint32_t total = 0;
  uint32_t first = 0;
  uint32_t count = 0;
  bool operator==(const HeadMap&) const = default;
};

struct Component {
  std::string name;
  std::string tensor;
  uint64_t offset = 0;
  uint64_t cell_bytes = 0;
  std::optional<HeadMap> heads;  // absent: replicated on every rank
  std::vector<Axis> axes;        // any order; position axes are outermost first
  bool operator==(const Component&) const = default;

  // Number of positions per block: the product of the position axes' sizes (1
  // when there are none).
  uint64_t positions_per_block() const;
  // Local heads held: heads->count, or 1 for a replicated component.
  uint64_t local_heads() const { return heads ? heads->count : 1; }
  // True when no byte is ever addressed (zero cells or zero cell bytes, or
  // no axes: a component of a layer this rank does not hold).
  bool empty() const;
};

struct Layer {
  std::string name;
  std::vector<Component> components;
  // False for a layer of the model that this rank does not hold (another PP
  // stage's): its components have a name, cell_bytes and heads (the
  // identity) and no tensor, offset or axes.
  bool held = true;
  bool operator==(const Layer&) const = default;
};

// Where a token of a request lives in one side's block list: list entry
// `entry`, at token offset `token` inside that block.
struct BlockSlot {
  uint64_t entry = 0;
  uint64_t token = 0;
  bool operator==(const BlockSlot&) const = default;
};

// Context parallelism (token sharding): a group's positions dealt over
// `size` shards in chunks of `interleave` positions, round robin. Position p
// (a token, or a state of tokens_per_state tokens) is on shard
// (p / interleave) % size, and it is position
//   (p / (interleave * size)) * interleave + p % interleave
// of that shard: a shard's positions are numbered densely, and its block
// list holds them as any group's (position q in entry q / positions per
// block). With size 1 (the default) every position is on the one shard.
// vLLM's decode context parallelism (cp_kv_cache_interleave_size I, dcp
// rank r of n) is {n, r, I}, for I dividing the block size.
struct ContextShard {
  uint32_t size = 1;
  uint32_t rank = 0;  // this rank's shard, < size
  uint64_t interleave = 1;
  bool operator==(const ContextShard&) const = default;

  bool sharded() const { return size > 1; }
  // The shard holding position p.
  uint32_t shard_of(uint64_t p) const { return static_cast<uint32_t>(p / interleave % size); }
  bool holds(uint64_t p) const { return shard_of(p) == rank; }
  // Position p's number on the shard that holds it.
  uint64_t local_of(uint64_t p) const { return p / (interleave * size) * interleave + p % interleave; }
  // The position that is number q of this rank's shard.
  uint64_t global_of(uint64_t q) const { return (q / interleave * size + rank) * interleave + q % interleave; }
  // How many of positions [0, n) shard `shard` holds.
  uint64_t count(uint64_t n, uint32_t shard) const {
    const uint64_t cycle = interleave * size, full = n / cycle, rest = n % cycle;
    const uint64_t before = uint64_t{shard} * interleave;
    return full * interleave + (rest > before ? std::min(rest - before, interleave) : 0);
  }
};

struct Group {
  std::string name;
  GroupKind kind = GroupKind::kAttention;
  uint64_t block_tokens = 0;
  uint64_t tokens_per_state = 1;
  std::optional<uint64_t> window_tokens;  // sliding_window only
  bool prefix_cacheable = true;
  bool transfer = true;
  uint64_t num_blocks = 0;
  std::vector<Layer> layers;
  // Which share of the positions this rank holds (attention and
  // sliding_window groups only; the default: all of them).
  ContextShard context;
  bool operator==(const Group&) const = default;

  // Positions in one block: block_tokens / tokens_per_state for token-indexed
  // kinds (attention, sliding_window, scratch), 1 for state.
  uint64_t positions_per_block() const;

  // Block lists (DESIGN.md, "What a request transfers") start at the
  // request's first token, so token t lives in entry t / block_tokens at
  // offset t % block_tokens (position p in entry p / positions_per_block()).
  // In a context-sharded group the token's slot is on the shard holding it,
  // by its number there (ContextShard). Requires a valid group.
  BlockSlot slot_of_token(uint64_t token) const;
  // The number of list entries that hold tokens [0, num_tokens):
  // ceil(num_tokens / block_tokens); in a context-sharded group, those of
  // shard 0, which holds the most (the ranks of an instance share one list,
  // as engines share one block table). A state group's list covering
  // num_tokens > 0 tokens holds the final state in its last entry,
  // entries_for_tokens(num_tokens) - 1 (and, in an engine's align mode, the
  // state at token (i + 1) * block_tokens in entry i).
  uint64_t entries_for_tokens(uint64_t num_tokens) const;
};

struct Layout {
  std::string model;
  std::string dtype;
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  // Pipeline stages: this rank is TP rank tp_rank of stage pp_rank of
  // pp_size; with pp_size 1 it holds every layer.
  uint32_t pp_size = 1;
  uint32_t pp_rank = 0;
  std::vector<Tensor> tensors;
  std::vector<Group> groups;
  bool operator==(const Layout&) const = default;

  // Lookups by name; nullptr when absent.
  const Tensor* find_tensor(std::string_view name) const;
  const Group* find_group(std::string_view name) const;
  // This rank's index in its instance: pp_rank * tp_size + tp_rank (the
  // tp_rank when there is one stage).
  uint32_t rank() const { return pp_rank * tp_size + tp_rank; }
};

// The model's layer order: every layer name of the layout (held or not),
// once, sorted by the number the name ends with ("layers.12": 12), ties and
// names without a number by name (those after the numbered ones). Layer
// names are part of a layout's identity, so both sides of a transfer agree
// on it.
std::vector<std::string> layer_order(const Layout& layout);

// The layers of `order` (a layer_order()) that PP stage `pp_rank` of
// `pp_size` holds, as engines partition them (vLLM's get_pp_indices): each
// stage a contiguous range of order.size() / pp_size layers, and one more
// for each of the stages before the last that the remainder reaches,
// counted back from the second to last. Requires 1 <= pp_size <=
// order.size() and pp_rank < pp_size.
std::set<std::string, std::less<>> pp_stage_layers(const std::vector<std::string>& order, uint32_t pp_size,
                                                   uint32_t pp_rank);

// `layout` as a rank of PP stage `pp_rank` of `pp_size` that holds only the
// layers named in `held`: every other layer is marked not held (its
// components keep name, cell_bytes and heads). The tensors stay as they
// are; a preset builds a stage's own, smaller tensors (presets.h).
Layout as_pp_stage(Layout layout, uint32_t pp_size, uint32_t pp_rank, const std::set<std::string, std::less<>>& held);

// True when two groups of the layout have components in one tensor (the
// hybrid allocator's overlay): such groups must not be given the same block
// ids in one request.
bool has_overlay(const Layout& layout);

// `layout` with the cells of every layer whose name is not in `keep` emptied
// (cell_bytes 0: a component that addresses no byte, which validate()
// accepts). Planning, filling or checking a request against it touches the
// kept layers' bytes alone, at the same offsets and semantic coordinates:
// how one layer is written (a streaming prefill) or checked (a stage).
Layout keep_layers(Layout layout, const std::set<std::string, std::less<>>& keep);

// Checks every rule of docs/formats/layout.md. Returns OK, or kInvalidArgument
// (structure, names, types of values), kOutOfRange (a cell outside its tensor,
// overlapping cells) or kResourceExhausted (a bound above), with a message that
// names the group, layer and component at fault, e.g.
//   "group 'indexer_tail' layer 'layers.3' component 'tail': cells end at byte
//    N, past the end of tensor 'idx.3' (M bytes)".
Status validate(const Layout& layout);

// ---------------------------------------------------------------------------
// Memory of a rank, as host functions see it.
//
// One span per tensor of a layout, in layout order, each exactly the tensor's
// bytes. The caller owns the memory and keeps it alive and unaliased by
// other writers for the duration of the call it is passed to.
using TensorMemory = std::span<const std::span<uint8_t>>;
// The same, read only.
using ConstTensorMemory = std::span<const std::span<const uint8_t>>;

// OK when `memory` has one span per tensor of `layout`, each of the tensor's
// bytes; otherwise kInvalidArgument naming the count or the tensor, e.g.
//   "memory for tensor 'kv.3' is 4096 bytes, the layout says 8192".
Status check_memory(const Layout& layout, TensorMemory memory);

// The coordinate of one cell of a component: block id, local head (0 for a
// replicated component), and position within the block.
struct CellIndex {
  uint64_t block = 0;
  uint64_t head = 0;
  uint64_t position = 0;
};

// Byte offset of a cell from the start of the component's tensor: offset +
// sum(index * stride), where the position is split over the position axes as
// a mixed-radix number (outermost axis first). Returns kOutOfRange naming the
// axis when an index is past its size. Requires a valid layout.
Result<uint64_t> cell_offset(const Component& component, const CellIndex& cell);

// Bytes of one tensor: [offset, offset + bytes) of layout.tensors[tensor].
struct TensorSpan {
  uint32_t tensor = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool operator==(const TensorSpan&) const = default;
};

// Exactly the bytes of blocks `blocks` of `group` (ids below 0 skipped):
// every cell of those blocks, in every held layer and component, and no
// other byte, as spans sorted by (tensor, offset) and merged where they
// touch. What a reader of those blocks may need, whatever its own layout
// (a prefill grants it to its readers). A component's axes that are dense
// below its cell (each stride the bytes of the axes inside it) make one
// span per block; the others are walked. kOutOfRange naming the group for
// an id not below num_blocks. Requires a valid layout and a group of it.
Result<std::vector<TensorSpan>> block_spans(const Layout& layout, const Group& group, std::span<const int64_t> blocks);

// The same bytes as block_spans(), in the form a grant takes
// (Engine::grant_reads with repeats): components of one shape (block
// stride, and one block's runs) in other tensors, or elsewhere in one, are
// repeats of the first one's spans at a shift, so that an 80-layer model's
// request is its blocks' spans in one tensor and 159 repeats, not 1.3 M
// spans. `spans` are sorted and merged within each repeated range.
struct BlockPlaces {
  struct Repeat {
    uint64_t first = 0, count = 0;  // spans [first, first + count)
    uint32_t tensor = 0;            // again in this tensor...
    uint64_t shift = 0;             // ...at their offset plus this (modulo 2^64)
  };
  std::vector<TensorSpan> spans;
  std::vector<Repeat> repeats;
};
Result<BlockPlaces> block_places(const Layout& layout, const Group& group, std::span<const int64_t> blocks);

// The stride of the first axis of `kind` in `component`, or nullopt.
std::optional<uint64_t> axis_stride(const Component& component, AxisKind kind);

// The strides of the position axes (outermost first) and their sizes, for code
// that walks positions: position p has digits d_i with p = sum d_i * radix_i.
struct PositionAxes {
  std::vector<uint64_t> sizes;
  std::vector<uint64_t> strides;
  // Byte offset of position p within one (block, head): sum of digit * stride.
  uint64_t offset_of(uint64_t position) const;
};
PositionAxes position_axes(const Component& component);

// ---------------------------------------------------------------------------
// Identity and compatibility.
//
// Two ranks can exchange KV exactly when their identities are equal: model,
// dtype, each group's name, kind, tokens_per_state and window_tokens, each
// layer's name, and each component's name, cell_bytes and total heads (or
// "replicated"). TP size, PP stages (which layers a rank holds), context
// shards, block
// sizes, strides, axis order, tensors, num_blocks and memory kind are not
// part of it.

// A canonical, platform-independent text of the identity (groups in name
// order, layers and components in layout order). Stable across versions of
// kvbridge that keep the layout format at /1.
std::string identity_text(const Layout& layout);

// A stable 64-bit hash of identity_text() (XXH3-64, seed 0). Equal identities
// have equal hashes on any machine.
uint64_t compatibility_hash(const Layout& layout);

// The compatibility hash as 16 lower-case hex digits.
std::string compatibility_hash_hex(const Layout& layout);

// OK when the two layouts can exchange KV; otherwise kIncompatible naming the
// first field that differs and both values, e.g.
//   "group 'mla' layer 'layers.0' component 'rope': cell_bytes differs: 128 vs 64".
Status check_compatible(const Layout& local, const Layout& remote);

// Compares two identity_text() outputs, typically this rank's and one a peer
// sent over the side channel. Returns OK when they are byte-for-byte equal;
// otherwise kIncompatible naming the first field that differs in the words
// check_compatible() uses for the layouts they came from, e.g.
//   "group 'full' layer 'layers.0' component 'k': heads.total differs: 8 vs 4".
// Either text may be arbitrary bytes (the remote one comes from a peer): the
// work is linear in the input, and when a text is not a well-formed identity
// the message falls back to the first differing line,
//   "identity line 7 differs: '<local line>' vs '<remote line>'",
// with each value cut to about 120 bytes and control bytes escaped as \xNN.
Status compare_identity_text(std::string_view local, std::string_view remote);

}  // namespace kvbridge

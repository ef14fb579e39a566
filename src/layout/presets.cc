// Preset layouts of public model architectures. The figures and the public
// architectures they are modelled on are in docs/presets.md; this file turns
// them into geometry.
//
// Every preset is described in two steps. First, each group lists its layers,
// and each layer lists its *pages*: the bytes of one block of that layer in
// one tensor slot (a slot of a tensor family such as "kv" or "idx"), with the
// components packed inside the page. Second, assemble() sizes every slot (the
// largest page placed in it, so overlays always fit), turns the slots into
// tensors according to the order (one tensor per slot for LB*, one block-major
// tensor per family for BLHNC) and writes each component's axes. Overlays
// (gpt-oss's SWA and full layers, GLM's KDA state over MLA pages and its
// indexer tail inside indexer pages) are simply several pages in one slot,
// which is how vLLM's hybrid allocator shares one KVCacheTensor between groups
// (vllm-connectors.md §1.4, §1.7).

#include "kvbridge/presets.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <utility>

#include "common/checked.h"

namespace kvbridge {
namespace {

using std::to_string;

// The options after the preset's defaults are applied.
struct Options {
  std::string model;
  uint32_t tp = 1;
  uint32_t rank = 0;
  uint64_t block_tokens = 0;
  uint64_t kernel_tokens = 0;
  uint64_t num_blocks = 0;
  uint64_t state_blocks = 0;  // of state and scratch groups with tensors of their own
  Order order = Order::kLBHNC;
  uint32_t spec_tokens = 0;
};

// One array of a page and the bytes of one of its cells.
struct Part {
  std::string name;
  uint64_t cell_bytes = 0;
};

// One block of one layer in one tensor slot. A token page is [r kernel pages]
// of [H][n][C] (LBHNC, BLHNC) or [n][H][C] (LBNHC), where C packs the parts
// side by side (k then v). A state page (positions == 0) is [H][cell] per
// part, the parts one after the other.
struct Page {
  std::vector<Part> parts;
  std::optional<HeadMap> heads;   // shared by every part; absent: replicated
  uint64_t positions = 0;         // per block; 0 for a state page
  uint64_t kernel_positions = 0;  // per kernel page

  uint64_t local_heads() const { return heads ? heads->count : 1; }
  uint64_t content_bytes() const {
    uint64_t c = 0;
    for (const Part& p : parts) c += p.cell_bytes;
    return c;
  }
  // Small by construction (block_tokens <= kMaxBlockTokens, cells of a few
  // KiB, at most a few dozen heads), so this cannot overflow.
  uint64_t bytes() const { return local_heads() * std::max<uint64_t>(positions, 1) * content_bytes(); }
};

struct Placed {
  std::string family;  // tensor family: "kv", "idx", "state", ...
  uint32_t slot = 0;
  Page page;
};

struct LayerSpec {
  std::string name;
  std::vector<Placed> pages;  // components in page order, parts in part order
};

struct GroupSpec {
  Group group;  // everything but layers
  std::vector<LayerSpec> layers;
};

Status bad(std::string message) { return Status::invalid_argument(std::move(message)); }

// Heads of a head-sharded array with `total` heads at this rank (the rule of
// docs/presets.md): TP <= heads splits them evenly, TP > heads gives each rank
// one head, held by tp/total consecutive ranks.
Result<HeadMap> shard(uint32_t total, const Options& o, std::string_view what) {
  const bool ok = o.tp <= total ? total % o.tp == 0 : o.tp % total == 0;
  if (!ok) {
    return bad("--tp " + to_string(o.tp) + ": " + o.model + " has " + to_string(total) + " " + std::string(what) +
               "; the TP size must divide " + to_string(total) + " or be a multiple of it");
  }
  if (o.tp <= total) {
    const uint32_t count = total / o.tp;
    return HeadMap{total, o.rank * count, count};
  }
  return HeadMap{total, o.rank / (o.tp / total), 1};
}

Page token_page(std::vector<Part> parts, std::optional<HeadMap> heads, uint64_t block_tokens, uint64_t kernel_tokens,
                uint64_t tokens_per_state = 1) {
  return Page{std::move(parts), heads, block_tokens / tokens_per_state, kernel_tokens / tokens_per_state};
}

Page state_page(std::vector<Part> parts, std::optional<HeadMap> heads) { return Page{std::move(parts), heads, 0, 0}; }

GroupSpec make_group(std::string name, GroupKind kind, uint64_t block_tokens, const Options& o) {
  GroupSpec g;
  g.group.name = std::move(name);
  g.group.kind = kind;
  g.group.block_tokens = block_tokens;
  g.group.num_blocks = one_block_per_request(kind) ? o.state_blocks : o.num_blocks;  // assemble() settles it
  return g;
}

std::string layer_name(uint32_t i) { return "layers." + to_string(i); }

// ---------------------------------------------------------------------------
// The presets.

constexpr uint64_t kBf16 = 2;

Result<std::vector<GroupSpec>> llama(const Options& o, uint32_t num_layers) {
  KVB_ASSIGN_OR_RETURN(HeadMap heads, shard(8, o, "KV heads"));
  GroupSpec full = make_group("full", GroupKind::kAttention, o.block_tokens, o);
  for (uint32_t i = 0; i < num_layers; ++i) {
    Page page = token_page({{"k", 128 * kBf16}, {"v", 128 * kBf16}}, heads, o.block_tokens, o.kernel_tokens);
    full.layers.push_back({layer_name(i), {{"kv", i, std::move(page)}}});
  }
  return std::vector<GroupSpec>{std::move(full)};
}

// DeepSeek-V3's MLA: 512 latent + 64 rope bf16 per token, replicated. V3.2 adds
// the lightning indexer's 128 fp8 + 4 B scale per token, in its own tensor.
GroupSpec deepseek_mla(const Options& o, bool indexer) {
  GroupSpec mla = make_group("mla", GroupKind::kAttention, o.block_tokens, o);
  for (uint32_t i = 0; i < 61; ++i) {
    LayerSpec layer{layer_name(i), {}};
    layer.pages.push_back(
        {"kv", i,
         token_page({{"latent", 512 * kBf16}, {"rope", 64 * kBf16}}, std::nullopt, o.block_tokens, o.kernel_tokens)});
    if (indexer) {
      layer.pages.push_back({"idx", i, token_page({{"index", 132}}, std::nullopt, o.block_tokens, o.kernel_tokens)});
    }
    mla.layers.push_back(std::move(layer));
  }
  return mla;
}

Result<std::vector<GroupSpec>> deepseek(const Options& o, bool indexer) {
  return std::vector<GroupSpec>{deepseek_mla(o, indexer)};
}

Result<std::vector<GroupSpec>> mla_with_draft(const Options& o) {
  KVB_ASSIGN_OR_RETURN(HeadMap heads, shard(8, o, "draft KV heads"));
  std::vector<GroupSpec> groups{deepseek_mla(o, false)};
  GroupSpec draft = make_group("draft", GroupKind::kAttention, o.block_tokens, o);
  draft.layers.push_back(
      {"draft.layers.0",
       {{"draft.kv", 0,
         token_page({{"k", 128 * kBf16}, {"v", 128 * kBf16}}, heads, o.block_tokens, o.kernel_tokens)}}});
  groups.push_back(std::move(draft));
  return groups;
}

// Rounds `bytes / per_block` up to a block size that is a multiple of `step`.
uint64_t min_block_tokens(uint64_t bytes, uint64_t per_token, uint64_t step) {
  const uint64_t tokens = (bytes + per_token - 1) / per_token;
  return (tokens + step - 1) / step * step;
}

// GLM-5.x-Flash ("Glm5Next", vllm-connectors.md §1.7).
Result<std::vector<GroupSpec>> glm5_flash(const Options& o) {
  constexpr uint32_t kLayers = 45;
  constexpr uint64_t kKpool = 4;             // tokens per indexer state
  constexpr uint64_t kMlaTokenBytes = 1152;  // latent + rope
  constexpr uint64_t kIndexCell = 132;
  constexpr uint64_t kTailPositions = 4;
  constexpr uint64_t kTailCell = 512;
  constexpr uint64_t kConvCell = 3 * 384 * kBf16;
  constexpr uint64_t kSsmCell = 128 * 128 * kBf16;
  constexpr uint32_t kKdaGroups = 4;  // ceil(34 KDA layers / 11 MLA slots)

  if (o.kernel_tokens % kKpool != 0) {
    return bad("--kernel-block-tokens " + to_string(o.kernel_tokens) + ": glm5-flash's indexer keeps one state per " +
               to_string(kKpool) + " tokens, so a kernel block must be a multiple of " + to_string(kKpool) + " tokens");
  }
  KVB_ASSIGN_OR_RETURN(HeadMap kda_heads, shard(16, o, "KDA heads"));
  const uint64_t mla_page = o.block_tokens * kMlaTokenBytes;
  const uint64_t state_bytes = kda_heads.count * (kConvCell + kSsmCell);
  if (state_bytes > mla_page) {
    return bad("--block-tokens " + to_string(o.block_tokens) + ": glm5-flash's KDA state page at TP " +
               to_string(o.tp) + " (" + to_string(state_bytes) + " B) does not fit the MLA page (" +
               to_string(o.block_tokens) + " tokens x " + to_string(kMlaTokenBytes) + " B = " + to_string(mla_page) +
               " B) it overlays; the smallest block that fits is " +
               to_string(min_block_tokens(state_bytes, kMlaTokenBytes, o.kernel_tokens)) + " tokens");
  }
  const uint64_t tail_bytes = kTailPositions * kTailCell;
  const uint64_t index_page = o.block_tokens / kKpool * kIndexCell;
  if (tail_bytes > index_page) {
    return bad("--block-tokens " + to_string(o.block_tokens) + ": glm5-flash's indexer page (" + to_string(index_page) +
               " B) cannot hold the " + to_string(tail_bytes) +
               " B indexer tail placed at its start; the smallest block that fits is " +
               to_string(min_block_tokens(tail_bytes * kKpool, kIndexCell, o.kernel_tokens)) + " tokens");
  }

  GroupSpec mla = make_group("mla", GroupKind::kAttention, o.block_tokens, o);
  GroupSpec indexer = make_group("indexer", GroupKind::kAttention, o.block_tokens, o);
  indexer.group.tokens_per_state = kKpool;
  GroupSpec tail = make_group("indexer_tail", GroupKind::kScratch, kTailPositions, o);
  tail.group.prefix_cacheable = false;
  std::vector<GroupSpec> kda;
  for (uint32_t g = 0; g < kKdaGroups; ++g) {
    kda.push_back(make_group("kda." + to_string(g), GroupKind::kState, o.block_tokens, o));
  }
  uint32_t kda_index = 0;
  for (uint32_t i = 0; i < kLayers; ++i) {
    if (i % 4 == 3) {
      const uint32_t slot = i / 4;
      mla.layers.push_back({layer_name(i),
                            {{"kv", slot,
                              token_page({{"latent", 512 * kBf16}, {"rope", 64 * kBf16}}, std::nullopt, o.block_tokens,
                                         o.kernel_tokens)}}});
      indexer.layers.push_back(
          {layer_name(i),
           {{"idx", slot,
             token_page({{"index", kIndexCell}}, std::nullopt, o.block_tokens, o.kernel_tokens, kKpool)}}});
      // The tail sits at the start of the indexer page of the same slot.
      tail.layers.push_back(
          {layer_name(i),
           {{"idx", slot, token_page({{"tail", kTailCell}}, std::nullopt, kTailPositions, kTailPositions)}}});
    } else {
      // Round robin over the KDA groups; the s-th layer of each overlays the
      // MLA page of slot s.
      const uint32_t slot = kda_index / kKdaGroups;
      kda[kda_index % kKdaGroups].layers.push_back(
          {layer_name(i), {{"kv", slot, state_page({{"conv", kConvCell}, {"ssm", kSsmCell}}, kda_heads)}}});
      ++kda_index;
    }
  }
  std::vector<GroupSpec> groups{std::move(mla), std::move(indexer), std::move(tail)};
  for (GroupSpec& g : kda) groups.push_back(std::move(g));
  return groups;
}

// Qwen3-Next-80B-A3B: 3 Gated DeltaNet layers to 1 full attention layer.
Result<std::vector<GroupSpec>> qwen3_next(const Options& o) {
  if (o.spec_tokens > 4) {
    return bad("--spec-tokens " + to_string(o.spec_tokens) +
               ": qwen3-next's ring holds 8 slots, room for at most 4 speculative tokens");
  }
  KVB_ASSIGN_OR_RETURN(HeadMap kv_heads, shard(2, o, "KV heads"));
  KVB_ASSIGN_OR_RETURN(HeadMap linear_heads, shard(16, o, "linear-attention head groups"));
  const uint64_t ring_tokens = o.spec_tokens > 0 ? 8 : 4;

  GroupSpec full = make_group("full", GroupKind::kAttention, o.block_tokens, o);
  GroupSpec linear = make_group("linear", GroupKind::kState, o.block_tokens, o);
  GroupSpec ring = make_group("ring", GroupKind::kScratch, ring_tokens, o);
  ring.group.prefix_cacheable = false;
  uint32_t linear_slot = 0;
  for (uint32_t i = 0; i < 48; ++i) {
    if (i % 4 == 3) {
      const uint32_t slot = i / 4;
      full.layers.push_back(
          {layer_name(i),
           {{"kv", slot,
             token_page({{"k", 256 * kBf16}, {"v", 256 * kBf16}}, kv_heads, o.block_tokens, o.kernel_tokens)}}});
      ring.layers.push_back(
          {layer_name(i), {{"ring", slot, token_page({{"ring", 1024}}, kv_heads, ring_tokens, ring_tokens)}}});
    } else {
      linear.layers.push_back({layer_name(i),
                               {{"state", linear_slot++,
                                 state_page({{"conv", 3 * 512 * kBf16}, {"ssm", 2 * 128 * 128 * 4}}, linear_heads)}}});
    }
  }
  return std::vector<GroupSpec>{std::move(full), std::move(linear), std::move(ring)};
}

// gpt-oss-120b: sliding window and full attention alternate; the hybrid
// allocator gives the s-th layer of both groups one shared tensor slot.
Result<std::vector<GroupSpec>> gpt_oss(const Options& o) {
  KVB_ASSIGN_OR_RETURN(HeadMap heads, shard(8, o, "KV heads"));
  GroupSpec swa = make_group("swa", GroupKind::kSlidingWindow, o.block_tokens, o);
  swa.group.window_tokens = 128;
  GroupSpec full = make_group("full", GroupKind::kAttention, o.block_tokens, o);
  for (uint32_t i = 0; i < 36; ++i) {
    Page page = token_page({{"k", 64 * kBf16}, {"v", 64 * kBf16}}, heads, o.block_tokens, o.kernel_tokens);
    (i % 2 == 0 ? swa : full).layers.push_back({layer_name(i), {{"kv", i / 2, std::move(page)}}});
  }
  return std::vector<GroupSpec>{std::move(swa), std::move(full)};
}

struct PresetDef {
  std::string_view name;
  std::string_view summary;
  uint64_t block_tokens;
  uint64_t kernel_tokens;
  uint64_t num_blocks;
  std::function<Result<std::vector<GroupSpec>>(const Options&)> build;
};

const std::vector<PresetDef>& presets() {
  static const std::vector<PresetDef> defs = {
      {"llama3-8b", "Llama 3 8B: 32 layers, GQA 8 KV heads x 128, bf16; block 16", 16, 16, 1024,
       [](const Options& o) { return llama(o, 32); }},
      {"llama3-70b", "Llama 3 70B: 80 layers, GQA 8 KV heads x 128, bf16; block 16", 16, 16, 1024,
       [](const Options& o) { return llama(o, 80); }},
      {"deepseek-v3", "DeepSeek-V3: 61 MLA layers, latent 512 + rope 64 bf16, replicated; block 64", 64, 64, 1024,
       [](const Options& o) { return deepseek(o, false); }},
      {"deepseek-v3.2",
       "DeepSeek-V3.2: deepseek-v3 plus a 132 B/token sparse-attention indexer per layer in its "
       "own tensor; block 64",
       64, 64, 1024, [](const Options& o) { return deepseek(o, true); }},
      {"glm5-flash",
       "GLM-5.x-Flash (Glm5Next): 11 MLA + kpool indexer + tail layers, 34 KDA state layers "
       "overlaying the MLA pages; block 2304 over 64-token kernel blocks",
       2304, 64, 64, glm5_flash},
      {"qwen3-next",
       "Qwen3-Next-80B-A3B: 12 full attention layers (2 KV heads x 256), 36 Gated DeltaNet state "
       "layers, a 4-slot ring (8 with --spec-tokens); block 64",
       64, 64, 1024, qwen3_next},
      {"gpt-oss",
       "gpt-oss-120b: 36 layers alternating sliding window (128) and full, 8 KV heads x 64, "
       "sharing tensor slots; block 16",
       16, 16, 1024, gpt_oss},
      {"mla-with-draft",
       "deepseek-v3 target plus a 1-layer EAGLE-style GQA draft (8 KV heads x 128) in its own "
       "tensor; block 64",
       64, 64, 1024, mla_with_draft},
  };
  return defs;
}

const PresetDef* find_preset(std::string_view name) {
  for (const PresetDef& d : presets()) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

Result<Options> resolve(const PresetOptions& in, const PresetDef& def) {
  Options o;
  o.model = std::string(def.name);
  o.tp = in.tp_size;
  o.rank = in.tp_rank;
  o.order = in.order;
  o.spec_tokens = in.spec_tokens;
  if (o.tp == 0 || o.tp > kMaxTpSize) {
    return bad("--tp " + to_string(o.tp) + ": the TP size must be between 1 and " + to_string(kMaxTpSize));
  }
  if (o.rank >= o.tp) {
    return bad("--rank " + to_string(o.rank) + ": the rank must be below the TP size (--tp " + to_string(o.tp) + ")");
  }
  if (in.dcp_size == 0 || in.dcp_size > kMaxContextShards || o.tp % in.dcp_size != 0) {
    return bad("--dcp " + to_string(in.dcp_size) + ": the decode context-parallel size must divide the TP size (--tp " +
               to_string(o.tp) + ")");
  }
  if (in.dcp_interleave == 0 || in.dcp_interleave > kMaxBlockTokens) {
    return bad("--dcp-interleave " + to_string(in.dcp_interleave) + ": must be between 1 and " +
               to_string(kMaxBlockTokens) + " tokens");
  }
  // Heads are sharded over the TP ranks of one context shard.
  o.tp /= in.dcp_size;
  o.rank /= in.dcp_size;
  o.block_tokens = in.block_tokens != 0 ? in.block_tokens : def.block_tokens;
  if (o.block_tokens > kMaxBlockTokens) {
    return bad("--block-tokens " + to_string(o.block_tokens) + ": more than the limit of " +
               to_string(kMaxBlockTokens) + " tokens");
  }
  // Without an explicit kernel block, use the largest divisor of the block
  // that the preset's kernel block allows, as vLLM's select_common_block_size
  // does (vllm-connectors.md §1.6).
  o.kernel_tokens = in.kernel_block_tokens != 0 ? in.kernel_block_tokens : std::gcd(o.block_tokens, def.kernel_tokens);
  if (o.kernel_tokens > o.block_tokens || o.block_tokens % o.kernel_tokens != 0) {
    return bad("--kernel-block-tokens " + to_string(o.kernel_tokens) + ": the block of " + to_string(o.block_tokens) +
               " tokens (--block-tokens) must be a multiple of the kernel block");
  }
  o.num_blocks = in.num_blocks != 0 ? in.num_blocks : def.num_blocks;
  if (o.num_blocks > kMaxNumBlocks) {
    return bad("--num-blocks " + to_string(o.num_blocks) + ": more than the limit of " + to_string(kMaxNumBlocks));
  }
  o.state_blocks = in.state_blocks != 0 ? in.state_blocks : o.num_blocks;
  if (o.state_blocks > kMaxNumBlocks) {
    return bad("--state-blocks " + to_string(o.state_blocks) + ": more than the limit of " + to_string(kMaxNumBlocks));
  }
  return o;
}

// Where one slot lives.
struct Where {
  std::string tensor;
  uint64_t offset = 0;
  uint64_t block_stride = 0;
  uint64_t num_blocks = 0;
};

std::vector<Component> components_of(const Page& page, const Where& w, Order order) {
  const uint64_t h = page.local_heads();
  const uint64_t c = page.content_bytes();
  std::vector<Component> out;
  uint64_t at = 0;  // offset of the part within the cell group (token) or page (state)
  for (const Part& part : page.parts) {
    Component comp;
    comp.name = part.name;
    comp.tensor = w.tensor;
    comp.offset = w.offset + at;
    comp.cell_bytes = part.cell_bytes;
    comp.heads = page.heads;
    comp.axes.push_back({AxisKind::kBlock, w.num_blocks, w.block_stride});
    if (page.positions == 0) {
      if (page.heads) comp.axes.push_back({AxisKind::kHead, h, part.cell_bytes});
      at += h * part.cell_bytes;
    } else {
      const uint64_t n = page.kernel_positions;
      const uint64_t r = page.positions / n;
      if (r > 1) comp.axes.push_back({AxisKind::kPosition, r, h * n * c});
      if (order == Order::kLBNHC) {
        comp.axes.push_back({AxisKind::kPosition, n, h * c});
        if (page.heads) comp.axes.push_back({AxisKind::kHead, h, c});
      } else {
        if (page.heads) comp.axes.push_back({AxisKind::kHead, h, n * c});
        comp.axes.push_back({AxisKind::kPosition, n, c});
      }
      at += part.cell_bytes;
    }
    out.push_back(std::move(comp));
  }
  return out;
}

Status tensor_bytes(uint64_t row, uint64_t blocks, const char* option, const std::string& name, uint64_t* out) {
  if (!checked_mul(row, blocks, out) || *out > kMaxTensorBytes) {
    return bad(std::string(option) + " " + to_string(blocks) + ": tensor '" + name + "' of " + to_string(row) +
               " B per block would exceed the limit of " + to_string(kMaxTensorBytes) + " B");
  }
  return Status();
}

Result<Layout> assemble(const Options& o, const std::vector<GroupSpec>& groups) {
  // Slot sizes per family, families in order of first use. A family only
  // state and scratch groups use is a pool of state_blocks slots; one an
  // attention or sliding-window group uses (alone or overlaid) has
  // num_blocks.
  std::vector<std::string> families;
  std::map<std::string, std::vector<uint64_t>> slots;
  std::set<std::string> token_families;
  for (const GroupSpec& g : groups) {
    for (const LayerSpec& l : g.layers) {
      for (const Placed& p : l.pages) {
        if (!slots.contains(p.family)) families.push_back(p.family);
        std::vector<uint64_t>& s = slots[p.family];
        if (s.size() <= p.slot) s.resize(p.slot + 1, 0);
        s[p.slot] = std::max(s[p.slot], p.page.bytes());
      }
    }
  }
  // The families of attention and sliding-window groups, and every family
  // of a group that shares one of them (a state overlaying their pages
  // keeps their blocks).
  for (bool grew = true; grew;) {
    grew = false;
    for (const GroupSpec& g : groups) {
      bool token = !one_block_per_request(g.group.kind);
      for (const LayerSpec& l : g.layers) {
        for (const Placed& p : l.pages) token = token || token_families.contains(p.family);
      }
      if (!token) continue;
      for (const LayerSpec& l : g.layers) {
        for (const Placed& p : l.pages) grew = token_families.insert(p.family).second || grew;
      }
    }
  }

  Layout layout;
  layout.model = o.model;
  layout.dtype = "bf16";
  layout.tp_size = o.tp;
  layout.tp_rank = o.rank;
  std::map<std::pair<std::string, uint32_t>, Where> where;
  for (const std::string& f : families) {
    const std::vector<uint64_t>& pages = slots[f];
    const bool state_pool = !token_families.contains(f);
    const uint64_t blocks = state_pool ? o.state_blocks : o.num_blocks;
    const char* option = state_pool && o.state_blocks != o.num_blocks ? "--state-blocks" : "--num-blocks";
    if (o.order == Order::kBLHNC) {
      const uint64_t row = std::accumulate(pages.begin(), pages.end(), uint64_t{0});
      Tensor t{f, 0, "host"};
      KVB_RETURN_IF_ERROR(tensor_bytes(row, blocks, option, f, &t.bytes));
      uint64_t at = 0;
      for (uint32_t s = 0; s < pages.size(); ++s) {
        where[{f, s}] = Where{f, at, row, blocks};
        at += pages[s];
      }
      layout.tensors.push_back(std::move(t));
    } else {
      for (uint32_t s = 0; s < pages.size(); ++s) {
        if (pages[s] == 0) continue;  // a slot of layers another PP stage holds
        Tensor t{f + "." + to_string(s), 0, "host"};
        KVB_RETURN_IF_ERROR(tensor_bytes(pages[s], blocks, option, t.name, &t.bytes));
        where[{f, s}] = Where{t.name, 0, pages[s], blocks};
        layout.tensors.push_back(std::move(t));
      }
    }
  }

  for (const GroupSpec& g : groups) {
    Group group = g.group;
    for (const LayerSpec& l : g.layers) {
      Layer layer{l.name, {}};
      for (const Placed& p : l.pages) {
        const Where& w = where.at({p.family, p.slot});
        group.num_blocks = w.num_blocks;  // a group's families are all pools or all not
        for (Component& c : components_of(p.page, w, o.order)) {
          layer.components.push_back(std::move(c));
        }
      }
      group.layers.push_back(std::move(layer));
    }
    layout.groups.push_back(std::move(group));
  }
  return layout;
}

// The rank of PP stage options.pp_rank: the whole model's layout `full`
// with the layers of the other stages marked not held, and the tensors of a
// layout assembled from the stage's own layers (so a stage allocates only
// what it holds; block-major rows hold only its layers).
Result<Layout> pp_stage(const Options& o, const PresetOptions& options, std::vector<GroupSpec> groups, Layout full) {
  const std::vector<std::string> order = layer_order(full);
  if (options.pp_size == 0 || options.pp_size > std::min<size_t>(order.size(), kMaxPpSize)) {
    return bad("--pp " + to_string(options.pp_size) + ": " + o.model + " has " + to_string(order.size()) +
               " layers; the PP size must be between 1 and that");
  }
  if (options.pp_rank >= options.pp_size) {
    return bad("--pp-rank " + to_string(options.pp_rank) + ": the stage must be below the PP size (--pp " +
               to_string(options.pp_size) + ")");
  }
  const std::set<std::string, std::less<>> held = pp_stage_layers(order, options.pp_size, options.pp_rank);
  for (GroupSpec& g : groups) {
    std::erase_if(g.layers, [&](const LayerSpec& l) { return held.count(l.name) == 0; });
  }
  KVB_ASSIGN_OR_RETURN(Layout own, assemble(o, groups));
  Layout out = as_pp_stage(std::move(full), options.pp_size, options.pp_rank, held);
  out.tensors = std::move(own.tensors);
  for (size_t gi = 0; gi < out.groups.size(); ++gi) {
    size_t next = 0;  // the stage's layers come in the same order
    for (Layer& l : out.groups[gi].layers) {
      if (l.held) l = std::move(own.groups[gi].layers[next++]);
    }
  }
  return out;
}

}  // namespace

std::string_view order_name(Order order) {
  switch (order) {
    case Order::kLBHNC:
      return "LBHNC";
    case Order::kLBNHC:
      return "LBNHC";
    case Order::kBLHNC:
      return "BLHNC";
  }
  return "unknown";
}

Result<Order> parse_order(std::string_view name) {
  std::string upper(name);
  for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  for (Order order : all_orders()) {
    if (order_name(order) == upper) return order;
  }
  return bad("unknown order '" + std::string(name) + "' (expected LBHNC, LBNHC or BLHNC)");
}

std::vector<Order> all_orders() { return {Order::kLBHNC, Order::kLBNHC, Order::kBLHNC}; }

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const PresetDef& d : presets()) names.emplace_back(d.name);
  return names;
}

std::string preset_summary(std::string_view name) {
  const PresetDef* def = find_preset(name);
  return def ? std::string(def->summary) : std::string();
}

Result<Layout> make_preset(const PresetOptions& options) {
  const PresetDef* def = find_preset(options.name);
  if (def == nullptr) {
    std::string known;
    for (const PresetDef& d : presets()) known += (known.empty() ? "" : ", ") + std::string(d.name);
    return Status::not_found("unknown preset '" + options.name + "'; known presets: " + known);
  }
  KVB_ASSIGN_OR_RETURN(Options o, resolve(options, *def));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupSpec> groups, def->build(o));
  KVB_ASSIGN_OR_RETURN(Layout layout, assemble(o, groups));
  if (options.pp_size != 1 || options.pp_rank != 0) {
    KVB_ASSIGN_OR_RETURN(layout, pp_stage(o, options, std::move(groups), std::move(layout)));
  }
  if (options.dcp_size > 1) {
    layout.tp_size = options.tp_size;
    layout.tp_rank = options.tp_rank;
    for (Group& g : layout.groups) {
      if (g.kind != GroupKind::kAttention && g.kind != GroupKind::kSlidingWindow) continue;
      if (options.dcp_interleave % g.tokens_per_state != 0) {
        return bad("--dcp-interleave " + to_string(options.dcp_interleave) + ": group '" + g.name + "' keeps one " +
                   "position per " + to_string(g.tokens_per_state) + " tokens; the interleave must be a multiple");
      }
      g.context = {options.dcp_size, options.tp_rank % options.dcp_size, options.dcp_interleave / g.tokens_per_state};
    }
  }
  // The contract is that a preset always validates; a failure here is a bug
  // in this file, reported as such rather than handed out.
  Status valid = validate(layout);
  if (!valid.ok()) {
    return Status::internal("preset '" + o.model + "' built an invalid layout: " + valid.to_string());
  }
  return layout;
}

}  // namespace kvbridge

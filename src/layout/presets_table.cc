// The presets themselves: each preset's groups, layers and pages (the first
// of the two steps that presets.cc describes), and the table of presets with
// their summaries and default block sizes. The figures and the public
// architectures they are modelled on are in docs/presets.md.
#include <algorithm>
#include <optional>
#include <utility>

#include "layout/presets_internal.h"

namespace kvbridge::preset_internal {
namespace {

using std::to_string;

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

// Rounds `bytes / per_token` up to a block size that is a multiple of `step`.
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

}  // namespace

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

}  // namespace kvbridge::preset_internal

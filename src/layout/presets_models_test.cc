// The preset layouts of particular models: GLM-5's tail and KDA state,
// qwen3-next's ring, state blocks, gpt-oss's shared slots, and indexer and
// draft tensors alias or hold exactly the bytes they should.
#include <gtest/gtest.h>

#include <algorithm>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/presets.h"
#include "layout/presets_test_util.h"

namespace kvbridge {
namespace {

using namespace presets_testing;

TEST(PresetsTest, Glm5TailAliasesTheFirstBytesOfItsIndexerBlock) {
  for (uint32_t tp : {1u, 4u}) {
    for (Order order : all_orders()) {
      for (uint64_t block : {uint64_t{0}, other_block_tokens("glm5-flash")}) {
        const Layout layout = make(options("glm5-flash", tp, tp - 1, order, block));
        const Group* indexer = layout.find_group("indexer");
        const Group* tail = layout.find_group("indexer_tail");
        ASSERT_TRUE(indexer && tail);
        EXPECT_EQ(tail->kind, GroupKind::kScratch);
        EXPECT_FALSE(tail->prefix_cacheable);
        EXPECT_EQ(tail->layers.size(), indexer->layers.size());
        for (const Layer& tail_layer : tail->layers) {
          const Layer* index_layer = find_layer(*indexer, tail_layer.name);
          ASSERT_NE(index_layer, nullptr) << tail_layer.name;
          const Component* t = find_component(tail_layer, "tail");
          const Component* idx = find_component(*index_layer, "index");
          ASSERT_TRUE(t && idx);
          EXPECT_EQ(t->tensor, idx->tensor);
          EXPECT_EQ(axis_stride(*t, AxisKind::kBlock), axis_stride(*idx, AxisKind::kBlock));
          const uint64_t tail_bytes = t->positions_per_block() * t->cell_bytes;
          EXPECT_EQ(tail_bytes, 2048u);
          const Tensor* tensor = layout.find_tensor(t->tensor);
          ASSERT_NE(tensor, nullptr);
          for (uint64_t b : {uint64_t{0}, uint64_t{1}, tail->num_blocks - 1}) {
            const auto idx_cells = block_cells(*idx, b);
            const auto tail_cells = block_cells(*t, b);
            // The tail's cells tile exactly the first 2048 B of indexer block b.
            uint64_t at = idx_cells.front().first;
            for (const auto& [begin, end] : tail_cells) {
              EXPECT_EQ(begin, at) << tail_layer.name << " block " << b;
              at = end;
            }
            EXPECT_EQ(at, idx_cells.front().first + tail_bytes);
            EXPECT_LE(at, idx_cells.back().second);
            EXPECT_LE(at, tensor->bytes);
          }
        }
      }
    }
  }
}

TEST(PresetsTest, Glm5KdaStateOverlaysOneMlaPagePerLayer) {
  for (uint32_t tp : {1u, 2u, 4u, 8u, 16u}) {
    for (Order order : all_orders()) {
      const Layout layout = make(options("glm5-flash", tp, 0, order));
      const Group* mla = layout.find_group("mla");
      ASSERT_NE(mla, nullptr);
      size_t kda_layers = 0;
      for (const Group& g : layout.groups) {
        if (g.name.rfind("kda.", 0) != 0) continue;
        EXPECT_EQ(g.kind, GroupKind::kState);
        EXPECT_EQ(g.block_tokens, mla->block_tokens);
        EXPECT_LE(g.layers.size(), mla->layers.size());
        kda_layers += g.layers.size();
        std::set<std::string> overlaid;
        for (const Layer& layer : g.layers) {
          const Component* conv = find_component(layer, "conv");
          const Component* ssm = find_component(layer, "ssm");
          ASSERT_TRUE(conv && ssm) << layer.name;
          // The MLA layer whose page this state overlays.
          const Layer* host = nullptr;
          for (const Layer& m : mla->layers) {
            const Component* latent = find_component(m, "latent");
            if (latent->tensor == conv->tensor && offset_of(*latent, 1, 0, 0) == offset_of(*conv, 1, 0, 0)) {
              host = &m;
            }
          }
          ASSERT_NE(host, nullptr) << g.name << " " << layer.name << " overlays no MLA page";
          EXPECT_TRUE(overlaid.insert(host->name).second) << g.name << " reuses " << host->name;
          const Component* latent = find_component(*host, "latent");
          const Component* rope = find_component(*host, "rope");
          EXPECT_EQ(axis_stride(*conv, AxisKind::kBlock), axis_stride(*latent, AxisKind::kBlock));
          for (uint64_t b : {uint64_t{0}, g.num_blocks - 1}) {
            const uint64_t page_begin = block_cells(*latent, b).front().first;
            const uint64_t page_end = block_cells(*rope, b).back().second;
            EXPECT_EQ(block_cells(*conv, b).front().first, page_begin);
            EXPECT_LE(block_cells(*ssm, b).back().second, page_end) << layer.name << " tp " << tp;
          }
        }
      }
      EXPECT_EQ(kda_layers, 34u);
      EXPECT_EQ(mla->layers.size(), 11u);
    }
  }
}

// The number in "... the smallest block that fits is N tokens".
uint64_t named_minimum(const std::string& message) {
  std::smatch m;
  if (!std::regex_search(message, m, std::regex("smallest block that fits is ([0-9]+)"))) return 0;
  return std::stoull(m[1]);
}

TEST(PresetsTest, Glm5NamesTheSmallestBlockThatHoldsTheState) {
  for (uint32_t tp : {1u, 2u, 4u}) {
    Result<Layout> small = make_preset(options("glm5-flash", tp, 0, Order::kLBHNC, 64));
    ASSERT_FALSE(small.ok());
    EXPECT_EQ(small.error().code(), Code::kInvalidArgument);
    EXPECT_NE(small.error().message().find("--block-tokens"), std::string::npos);
    const uint64_t minimum = named_minimum(small.error().message());
    ASSERT_GT(minimum, 64u) << small.error().message();
    EXPECT_TRUE(make_preset(options("glm5-flash", tp, 0, Order::kLBHNC, minimum)).ok());
    EXPECT_FALSE(make_preset(options("glm5-flash", tp, 0, Order::kLBHNC, minimum - 64)).ok());
  }
}

TEST(PresetsTest, Glm5NamesTheSmallestBlockThatHoldsTheTail) {
  // At TP 16 the state fits a small page, but the tail needs 2048 B of indexer.
  PresetOptions o = options("glm5-flash", 16, 0, Order::kLBHNC, 32);
  o.kernel_block_tokens = 4;
  Result<Layout> small = make_preset(o);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.error().message().find("tail"), std::string::npos);
  o.block_tokens = named_minimum(small.error().message());
  ASSERT_GT(o.block_tokens, 32u) << small.error().message();
  EXPECT_TRUE(make_preset(o).ok());
}

TEST(PresetsTest, Qwen3NextRingIsAScratchOfFourSlotsOrEightWithSpeculation) {
  for (uint32_t spec : {0u, 3u}) {
    PresetOptions o = options("qwen3-next", 4, 3);
    o.spec_tokens = spec;
    const Layout layout = make(o);
    const Group* ring = layout.find_group("ring");
    const Group* full = layout.find_group("full");
    ASSERT_TRUE(ring && full);
    EXPECT_EQ(ring->kind, GroupKind::kScratch);
    EXPECT_FALSE(ring->prefix_cacheable);
    EXPECT_TRUE(ring->transfer);
    EXPECT_EQ(ring->block_tokens, spec > 0 ? 8u : 4u);
    ASSERT_EQ(ring->layers.size(), full->layers.size());
    for (size_t i = 0; i < ring->layers.size(); ++i) {
      EXPECT_EQ(ring->layers[i].name, full->layers[i].name);
    }
    EXPECT_EQ(layout.find_group("linear")->kind, GroupKind::kState);
  }
}

// A state pool of its own: qwen3-next's state and ring tensors (used by
// no attention group) hold state_blocks slots, at every order and PP
// stage, while glm5-flash's KDA state, overlaying MLA pages, keeps their
// num_blocks.
TEST(PresetsTest, StateBlocksSizeOnlyTensorsNoAttentionGroupUses) {
  for (Order order : all_orders()) {
    for (uint32_t pp : {1u, 3u}) {
      PresetOptions o = options("qwen3-next", 2, 1, order);
      o.num_blocks = 40;
      o.state_blocks = 3;
      o.pp_size = pp;
      o.pp_rank = pp - 1;
      const Layout layout = make(o);
      std::set<std::string> state_tensors;
      for (const Group& g : layout.groups) {
        const bool token = g.kind == GroupKind::kAttention;
        EXPECT_EQ(g.num_blocks, token ? 40u : 3u) << g.name;
        for (const Layer& l : g.layers) {
          for (const Component& c : l.components) {
            if (!l.held) continue;
            if (!token) state_tensors.insert(c.tensor);
            EXPECT_EQ(c.axes.front().size, g.num_blocks) << g.name << " " << c.name;
          }
        }
      }
      ASSERT_FALSE(state_tensors.empty());
      PresetOptions same = o;
      same.state_blocks = 0;  // num_blocks
      const Layout full = make(same);
      for (const Tensor& t : layout.tensors) {
        const Tensor* f = full.find_tensor(t.name);
        ASSERT_NE(f, nullptr) << t.name;
        if (state_tensors.contains(t.name)) {
          EXPECT_EQ(t.bytes * 40, f->bytes * 3) << t.name;  // 3 slots, not 40
        } else {
          EXPECT_EQ(t.bytes, f->bytes) << t.name;
        }
      }
    }
  }
  PresetOptions glm = options("glm5-flash");
  glm.num_blocks = 6;
  glm.state_blocks = 2;
  const Layout overlay = make(glm);
  for (const Group& g : overlay.groups) EXPECT_EQ(g.num_blocks, 6u) << g.name;

  PresetOptions big = options("qwen3-next");
  big.state_blocks = kMaxNumBlocks + 1;
  Result<Layout> bad = make_preset(big);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--state-blocks"), std::string::npos) << bad.status().to_string();
}

TEST(PresetsTest, GptOssGroupsShareOneTensorSlotPerLayerPair) {
  for (Order order : all_orders()) {
    const Layout layout = make(options("gpt-oss", 2, 0, order));
    const Group* swa = layout.find_group("swa");
    const Group* full = layout.find_group("full");
    ASSERT_TRUE(swa && full);
    EXPECT_EQ(swa->kind, GroupKind::kSlidingWindow);
    EXPECT_EQ(swa->window_tokens, std::optional<uint64_t>(128));
    ASSERT_EQ(swa->layers.size(), full->layers.size());
    for (size_t s = 0; s < swa->layers.size(); ++s) {
      EXPECT_EQ(swa->layers[s].components, full->layers[s].components) << "slot " << s;
    }
  }
}

TEST(PresetsTest, IndexerAndDraftLiveInTheirOwnTensors) {
  for (Order order : all_orders()) {
    const Layout v32 = make(options("deepseek-v3.2", 1, 0, order));
    for (const Layer& l : v32.groups[0].layers) {
      EXPECT_NE(find_component(l, "index")->tensor, find_component(l, "latent")->tensor);
    }
    const Layout draft = make(options("mla-with-draft", 8, 5, order));
    const Group* mla = draft.find_group("mla");
    const Group* d = draft.find_group("draft");
    ASSERT_TRUE(mla && d);
    std::set<std::string> target;
    for (const Layer& l : mla->layers) target.insert(l.components[0].tensor);
    for (const Component& c : d->layers.at(0).components) {
      EXPECT_FALSE(target.contains(c.tensor)) << c.tensor;
      ASSERT_TRUE(c.heads.has_value());
      EXPECT_EQ(c.heads->count, 1u);
    }
  }
}

}  // namespace
}  // namespace kvbridge

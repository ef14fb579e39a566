// Tests of the preset layouts: every preset validates across TP sizes, orders
// and block sizes; heads are sharded as docs/presets.md says; identity ignores
// what it must ignore; cells are where the documented order puts them. The
// overlays of particular models (GLM-5's tail and KDA state, gpt-oss's shared
// slots) are presets_models_test.cc's.

#include "kvbridge/presets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "layout/presets_test_util.h"

namespace kvbridge {
namespace {

using namespace presets_testing;

TEST(PresetsTest, EveryPresetValidatesAtEveryTpOrderAndTwoBlockSizes) {
  for (const std::string& name : preset_names()) {
    ASSERT_NE(other_block_tokens(name), 0u) << "choose a second block size for " << name;
    for (uint32_t tp : {1u, 2u, 4u, 8u}) {
      for (uint32_t rank = 0; rank < tp; ++rank) {
        for (Order order : all_orders()) {
          for (uint64_t block : {uint64_t{0}, other_block_tokens(name)}) {
            PresetOptions o = options(name, tp, rank, order, block);
            o.num_blocks = 0;  // the preset's default
            Result<Layout> layout = make_preset(o);
            ASSERT_TRUE(layout.ok()) << name << " tp " << tp << " rank " << rank << " " << order_name(order)
                                     << " block " << block << ": " << layout.status().to_string();
            EXPECT_TRUE(validate(*layout).ok()) << validate(*layout).to_string();
            EXPECT_EQ(layout->model, name);
            EXPECT_EQ(layout->tp_size, tp);
            EXPECT_EQ(layout->tp_rank, rank);
          }
        }
      }
    }
  }
}

TEST(PresetsTest, EveryPresetRoundTripsThroughJsonExactly) {
  // parse(to_json(x)) == x, and writing the parsed value gives the same text,
  // pretty and on one line, at every TP size, rank 0 and the last rank, in
  // every order. Under the sanitizers (where the JSON code runs many times slower)
  // each TP size and rank takes one order, the next one each time, so every
  // preset still meets every order.
  size_t checked = 0, combination = 0;
  const size_t orders = all_orders().size();
  for (const std::string& name : preset_names()) {
    for (uint32_t tp : {1u, 2u, 4u, 8u}) {
      for (uint32_t rank : {0u, tp - 1}) {
        ++combination;
        for (Order order : all_orders()) {
#ifdef KVB_PROPERTY_SANITIZED
          if (static_cast<size_t>(order) % orders != combination % orders) continue;
#endif
          Result<Layout> layout = make_preset(options(name, tp, rank, order, 0));
          ASSERT_TRUE(layout.ok()) << layout.status().to_string();
          for (int indent : {-1, 2}) {
            const std::string text = to_json(*layout, indent);
            Result<Layout> back = parse_layout(text);
            ASSERT_TRUE(back.ok()) << name << " tp " << tp << ": " << back.status().to_string();
            EXPECT_EQ(*back, *layout) << name << " tp " << tp << " rank " << rank << " " << order_name(order);
            EXPECT_EQ(to_json(*back, indent), text);
            ++checked;
          }
        }
      }
    }
  }
#ifdef KVB_PROPERTY_SANITIZED
  EXPECT_EQ(checked, preset_names().size() * 4 * 2 * 2);
#else
  EXPECT_EQ(checked, preset_names().size() * 4 * 2 * orders * 2);
#endif
}

TEST(PresetsTest, EveryPresetTakesTpSixteen) {
  for (const std::string& name : preset_names()) {
    for (uint32_t rank : {0u, 7u, 15u}) {
      Result<Layout> layout = make_preset(options(name, 16, rank));
      EXPECT_TRUE(layout.ok()) << name << ": " << layout.status().to_string();
    }
  }
}

TEST(PresetsTest, DefaultsApplyWhenOptionsAreZero) {
  for (const std::string& name : preset_names()) {
    PresetOptions o = options(name);
    o.num_blocks = 0;
    Layout layout = make(o);
    for (const Group& g : layout.groups) {
      EXPECT_GT(g.num_blocks, 0u) << name << " group " << g.name;
      EXPECT_GT(g.block_tokens, 0u) << name << " group " << g.name;
    }
  }
}

TEST(PresetsTest, HeadSlicesAcrossRanksCoverEveryGlobalHeadEvenly) {
  for (const std::string& name : preset_names()) {
    for (uint32_t tp : {1u, 2u, 4u, 8u, 16u}) {
      // (group, layer, component) -> how many ranks hold each global head.
      std::map<std::string, std::vector<uint32_t>> held;
      std::map<std::string, uint32_t> replicated;
      for (uint32_t rank = 0; rank < tp; ++rank) {
        Layout layout = make(options(name, tp, rank));
        for (const Group& g : layout.groups) {
          for (const Layer& l : g.layers) {
            for (const Component& c : l.components) {
              const std::string key = g.name + "/" + l.name + "/" + c.name;
              const bool has_head_axis = axis_stride(c, AxisKind::kHead).has_value();
              if (!c.heads) {
                EXPECT_FALSE(has_head_axis) << key;
                ++replicated[key];
                continue;
              }
              EXPECT_TRUE(has_head_axis) << key;
              std::vector<uint32_t>& counts = held[key];
              counts.resize(c.heads->total, 0);
              ASSERT_LE(c.heads->first + c.heads->count, c.heads->total) << key;
              for (uint32_t h = 0; h < c.heads->count; ++h) ++counts[c.heads->first + h];
            }
          }
        }
      }
      for (const auto& [key, counts] : held) {
        const uint32_t total = static_cast<uint32_t>(counts.size());
        const uint32_t expected = tp <= total ? 1 : tp / total;
        for (uint32_t h = 0; h < total; ++h) {
          EXPECT_EQ(counts[h], expected) << name << " tp " << tp << " " << key << " head " << h;
        }
      }
      for (const auto& [key, ranks] : replicated) {
        EXPECT_EQ(ranks, tp) << name << " tp " << tp << " " << key << " is not on every rank";
      }
    }
  }
}

TEST(PresetsTest, IdentityIgnoresTpBlockSizeAndOrder) {
  for (const std::string& name : preset_names()) {
    const Layout base = make(options(name));
    for (uint32_t tp : {1u, 2u, 4u, 8u}) {
      for (Order order : all_orders()) {
        for (uint64_t block : {uint64_t{0}, other_block_tokens(name)}) {
          const Layout other = make(options(name, tp, tp - 1, order, block));
          EXPECT_EQ(identity_text(other), identity_text(base))
              << name << " tp " << tp << " " << order_name(order) << " block " << block;
          EXPECT_EQ(compatibility_hash(other), compatibility_hash(base));
        }
      }
    }
  }
}

TEST(PresetsTest, IdentityDiffersBetweenPresets) {
  std::map<uint64_t, std::string> seen;
  for (const std::string& name : preset_names()) {
    const uint64_t hash = compatibility_hash(make(options(name)));
    auto [it, inserted] = seen.emplace(hash, name);
    EXPECT_TRUE(inserted) << name << " has the same identity as " << it->second;
  }
}

TEST(PresetsTest, LayerNamesAreUniqueWithinEachGroupAndEveryTensorIsUsed) {
  for (const std::string& name : preset_names()) {
    for (Order order : all_orders()) {
      const Layout layout = make(options(name, 1, 0, order));
      std::set<std::string> used;
      for (const Group& g : layout.groups) {
        std::set<std::string> names;
        for (const Layer& l : g.layers) {
          EXPECT_TRUE(names.insert(l.name).second) << name << " group " << g.name << " " << l.name;
          for (const Component& c : l.components) used.insert(c.tensor);
        }
      }
      for (const Tensor& t : layout.tensors) {
        EXPECT_TRUE(used.contains(t.name)) << name << " " << order_name(order) << " " << t.name;
      }
    }
  }
}

// docs/presets.md: within a kernel page, LBHNC is [H][n][C] and LBNHC is
// [n][H][C]; a block is r kernel pages; K and V are packed into C. BLHNC puts
// every layer's page in one row.
TEST(PresetsTest, AttentionCellsFollowTheDocumentedOrder) {
  constexpr uint64_t kBlock = 64, kKernel = 16, kCell = 256, kC = 2 * kCell;
  for (Order order : all_orders()) {
    PresetOptions o = options("llama3-8b", 2, 1, order, kBlock);
    o.kernel_block_tokens = kKernel;
    const Layout layout = make(o);
    ASSERT_EQ(layout.groups.size(), 1u);
    const Group& full = layout.groups[0];
    const uint64_t heads = 4;  // 8 KV heads over TP 2
    const uint64_t kernel_page = heads * kKernel * kC;
    const uint64_t page = (kBlock / kKernel) * kernel_page;
    const uint64_t row = order == Order::kBLHNC ? full.layers.size() * page : page;
    for (size_t l : {size_t{0}, size_t{5}}) {
      const Layer& layer = full.layers[l];
      const Component* k = find_component(layer, "k");
      const Component* v = find_component(layer, "v");
      ASSERT_TRUE(k && v);
      EXPECT_EQ(k->tensor, v->tensor);
      const uint64_t layer_base = order == Order::kBLHNC ? l * page : 0;
      for (uint64_t b : {0u, 3u}) {
        for (uint64_t h = 0; h < heads; ++h) {
          for (uint64_t p : {0u, 1u, 15u, 16u, 17u, 63u}) {
            const uint64_t in_kernel =
                order == Order::kLBNHC ? (p % kKernel) * heads * kC + h * kC : h * kKernel * kC + (p % kKernel) * kC;
            const uint64_t expected = b * row + layer_base + (p / kKernel) * kernel_page + in_kernel;
            EXPECT_EQ(offset_of(*k, b, h, p), expected) << order_name(order) << " b" << b << " h" << h << " p" << p;
            EXPECT_EQ(offset_of(*v, b, h, p), expected + kCell);
          }
        }
      }
    }
  }
}

TEST(PresetsTest, PositionAxesSplitAtTheKernelBlockOuterFirst) {
  PresetOptions o = options("deepseek-v3", 1, 0, Order::kLBHNC, 256);
  o.kernel_block_tokens = 64;
  const Layout split = make(o);
  const Component& latent = split.groups[0].layers[0].components[0];
  const PositionAxes axes = position_axes(latent);
  ASSERT_EQ(axes.sizes.size(), 2u);
  EXPECT_EQ(axes.sizes[0], 256u / 64u);
  EXPECT_EQ(axes.sizes[1], 64u);
  EXPECT_GT(axes.strides[0], axes.strides[1]);

  const Layout whole = make(options("deepseek-v3", 1, 0, Order::kLBHNC, 64));
  EXPECT_EQ(position_axes(whole.groups[0].layers[0].components[0]).sizes.size(), 1u);
}

TEST(PresetsTest, PagesOfUnsharedTensorsAreDense) {
  // In LB* orders a tensor that holds one layer's page has no gap and no
  // overlap inside a block.
  for (std::string name : {"llama3-8b", "deepseek-v3.2", "qwen3-next", "mla-with-draft"}) {
    for (Order order : {Order::kLBHNC, Order::kLBNHC}) {
      const Layout layout = make(options(name, 2, 1, order, other_block_tokens(name)));
      std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> cells;
      std::map<std::string, uint64_t> stride;
      for (const Group& g : layout.groups) {
        for (const Layer& l : g.layers) {
          for (const Component& c : l.components) {
            for (const auto& cell : block_cells(c, 1)) cells[c.tensor].push_back(cell);
            stride[c.tensor] = *axis_stride(c, AxisKind::kBlock);
          }
        }
      }
      for (auto& [tensor, list] : cells) {
        std::sort(list.begin(), list.end());
        uint64_t at = stride[tensor];
        for (const auto& [begin, end] : list) {
          ASSERT_EQ(begin, at) << name << " " << order_name(order) << " " << tensor;
          at = end;
        }
        EXPECT_EQ(at, 2 * stride[tensor]) << name << " " << tensor;
      }
    }
  }
}

void expect_error_naming(PresetOptions o, Code code, const std::string& needle) {
  Result<Layout> layout = make_preset(o);
  ASSERT_FALSE(layout.ok()) << o.name << " should fail, naming " << needle;
  EXPECT_EQ(layout.error().code(), code) << layout.error().to_string();
  EXPECT_NE(layout.error().message().find(needle), std::string::npos) << layout.error().to_string();
}

TEST(PresetsTest, BadOptionsGiveErrorsNamingTheOption) {
  expect_error_naming(options("llama3-8b", 3), Code::kInvalidArgument, "--tp");
  expect_error_naming(options("llama3-8b", 0), Code::kInvalidArgument, "--tp");
  expect_error_naming(options("qwen3-next", 6, 0), Code::kInvalidArgument, "--tp");  // 16 head groups
  expect_error_naming(options("llama3-8b", 4, 4), Code::kInvalidArgument, "--rank");
  expect_error_naming(options("deepseek-v3", 2, 7), Code::kInvalidArgument, "--rank");

  PresetOptions kernel = options("llama3-8b", 1, 0, Order::kLBHNC, 24);
  kernel.kernel_block_tokens = 16;
  expect_error_naming(kernel, Code::kInvalidArgument, "--kernel-block-tokens");
  kernel.kernel_block_tokens = 48;
  expect_error_naming(kernel, Code::kInvalidArgument, "--kernel-block-tokens");
  PresetOptions kpool = options("glm5-flash", 1, 0, Order::kLBHNC, 2304);
  kpool.kernel_block_tokens = 6;
  expect_error_naming(kpool, Code::kInvalidArgument, "--kernel-block-tokens");

  expect_error_naming(options("llama3-8b", 1, 0, Order::kLBHNC, kMaxBlockTokens + 1), Code::kInvalidArgument,
                      "--block-tokens");
  PresetOptions blocks = options("llama3-70b");
  blocks.num_blocks = kMaxNumBlocks;  // fine alone, too many bytes for one tensor
  blocks.block_tokens = 1u << 20;
  expect_error_naming(blocks, Code::kInvalidArgument, "--num-blocks");
  blocks.num_blocks = kMaxNumBlocks + 1;
  expect_error_naming(blocks, Code::kInvalidArgument, "--num-blocks");

  PresetOptions spec = options("qwen3-next");
  spec.spec_tokens = 5;
  expect_error_naming(spec, Code::kInvalidArgument, "--spec-tokens");

  expect_error_naming(options("llama4"), Code::kNotFound, "llama4");
  expect_error_naming(options(""), Code::kNotFound, "llama3-8b");
}

TEST(PresetsTest, KernelBlockDefaultsToADivisorOfTheBlock) {
  // Block 8 is below llama's 16-token kernel block; the kernel shrinks to fit.
  const Layout layout = make(options("llama3-8b", 1, 0, Order::kLBHNC, 8));
  EXPECT_EQ(layout.groups[0].block_tokens, 8u);
  EXPECT_EQ(position_axes(layout.groups[0].layers[0].components[0]).sizes, std::vector<uint64_t>{8});
}

TEST(PresetsTest, OrderNamesRoundTrip) {
  std::set<std::string> names;
  for (Order order : all_orders()) {
    Result<Order> parsed = parse_order(order_name(order));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, order);
    names.insert(std::string(order_name(order)));
  }
  EXPECT_EQ(names, (std::set<std::string>{"LBHNC", "LBNHC", "BLHNC"}));
  Result<Order> bad = parse_order("HNDL");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("HNDL"), std::string::npos);
}

TEST(PresetsTest, EveryPresetHasAUniqueNameAndASummary) {
  const std::vector<std::string> names = preset_names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
  for (const std::string& name : names) EXPECT_FALSE(preset_summary(name).empty()) << name;
  EXPECT_TRUE(preset_summary("no-such-model").empty());
}

}  // namespace
}  // namespace kvbridge

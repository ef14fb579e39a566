// Tests of the preset layouts: every preset validates across TP sizes, orders
// and block sizes; heads are sharded as docs/presets.md says; identity ignores
// what it must ignore; and the overlays (GLM-5's tail and KDA state, gpt-oss's
// shared slots) alias exactly the bytes they should.

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

namespace kvbridge {
namespace {

// A block size other than the default that each preset must take at TP 1..8
// (an input of the tests, chosen from docs/presets.md).
uint64_t other_block_tokens(const std::string& name) {
  static const std::map<std::string, uint64_t> blocks = {
      {"llama3-8b", 32},    {"llama3-70b", 32},  {"deepseek-v3", 128}, {"deepseek-v3.2", 128},
      {"glm5-flash", 1152}, {"qwen3-next", 128}, {"gpt-oss", 32},      {"mla-with-draft", 128},
  };
  auto it = blocks.find(name);
  return it == blocks.end() ? 0 : it->second;
}

PresetOptions options(const std::string& name, uint32_t tp = 1, uint32_t rank = 0, Order order = Order::kLBHNC,
                      uint64_t block_tokens = 0) {
  PresetOptions o;
  o.name = name;
  o.tp_size = tp;
  o.tp_rank = rank;
  o.order = order;
  o.block_tokens = block_tokens;
  o.num_blocks = 8;  // small, so that tests that walk blocks stay fast
  return o;
}

Layout make(const PresetOptions& o) {
  Result<Layout> layout = make_preset(o);
  EXPECT_TRUE(layout.ok()) << o.name << " tp " << o.tp_size << " rank " << o.tp_rank << ": "
                           << layout.status().to_string();
  return layout.ok() ? std::move(layout).value() : Layout{};
}

const Layer* find_layer(const Group& group, const std::string& name) {
  for (const Layer& l : group.layers) {
    if (l.name == name) return &l;
  }
  return nullptr;
}

const Component* find_component(const Layer& layer, const std::string& name) {
  for (const Component& c : layer.components) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

uint64_t offset_of(const Component& c, uint64_t block, uint64_t head, uint64_t position) {
  Result<uint64_t> off = cell_offset(c, CellIndex{block, head, position});
  EXPECT_TRUE(off.ok()) << c.name << ": " << off.status().to_string();
  return off.ok() ? *off : 0;
}

// Byte ranges [begin, end) of every cell of one block of a component.
std::vector<std::pair<uint64_t, uint64_t>> block_cells(const Component& c, uint64_t block) {
  std::vector<std::pair<uint64_t, uint64_t>> cells;
  for (uint64_t h = 0; h < c.local_heads(); ++h) {
    for (uint64_t p = 0; p < c.positions_per_block(); ++p) {
      const uint64_t at = offset_of(c, block, h, p);
      cells.emplace_back(at, at + c.cell_bytes);
    }
  }
  std::sort(cells.begin(), cells.end());
  return cells;
}

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

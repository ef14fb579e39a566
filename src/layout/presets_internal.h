// What the two halves of the presets share (presets_table.cc describes each
// preset's groups, layers and pages; presets.cc resolves the options and
// assembles the layout from them): the resolved options, the page model, the
// preset table's entries and the lookup into it. Not a public header.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/presets.h"

namespace kvbridge::preset_internal {

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

inline Status bad(std::string message) { return Status::invalid_argument(std::move(message)); }

// One entry of the preset table: the name, the summary for `kvbridge presets`,
// the defaults of the options and the function that describes the groups.
struct PresetDef {
  std::string_view name;
  std::string_view summary;
  uint64_t block_tokens;
  uint64_t kernel_tokens;
  uint64_t num_blocks;
  std::function<Result<std::vector<GroupSpec>>(const Options&)> build;
};

// Every preset, in a stable order (presets_table.cc).
const std::vector<PresetDef>& presets();
// The preset named `name`; null if unknown.
const PresetDef* find_preset(std::string_view name);

}  // namespace kvbridge::preset_internal

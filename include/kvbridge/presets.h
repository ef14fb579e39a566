// kvbridge/presets.h: layouts of public model architectures, for tools, tests
// and benchmarks. Each preset is modelled on a public architecture; the figures
// chosen are in docs/presets.md.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/status.h"

namespace kvbridge {

// Physical orders of a per-block page (outermost first). L = layer, B = block,
// H = head, N = position (token or state), C = the cell.
//  - kLBHNC: one tensor per layer (slot); heads before positions.
//  - kLBNHC: one tensor per layer (slot); positions before heads.
//  - kBLHNC: block-major: one tensor per group family whose block row holds
//    every layer's page (HNC inside).
enum class Order : uint8_t { kLBHNC, kLBNHC, kBLHNC };
std::string_view order_name(Order order);
Result<Order> parse_order(std::string_view name);
std::vector<Order> all_orders();

struct PresetOptions {
  std::string name;  // see preset_names()
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  uint64_t block_tokens = 0;         // 0: the preset's default
  uint64_t kernel_block_tokens = 0;  // 0: the preset's default
  Order order = Order::kLBHNC;
  uint64_t num_blocks = 0;  // 0: the preset's default
  // Blocks of the state and scratch groups whose tensors are their own
  // (qwen3-next's linear-attention state and ring): a pool of per-request
  // slots, as SGLang's mamba pool, rather than one slot per KV block.
  // Groups that overlay attention pages (glm5-flash's) keep num_blocks.
  // 0: num_blocks.
  uint64_t state_blocks = 0;
  uint32_t spec_tokens = 0;  // speculative tokens (qwen3-next ring capacity)
  // Pipeline stages: the rank holds the layers of stage pp_rank of pp_size
  // (pp_stage_layers(), layout.h), in tensors of its own layers only.
  uint32_t pp_size = 1;
  uint32_t pp_rank = 0;
  // Decode context parallelism, as vLLM deals it: the TP ranks form groups
  // of dcp_size consecutive ranks; heads are sharded over tp_size /
  // dcp_size (rank tp_rank / dcp_size), and every attention and
  // sliding-window group's tokens over the group's ranks (context shard
  // tp_rank % dcp_size) in chunks of dcp_interleave tokens.
  uint32_t dcp_size = 1;
  uint64_t dcp_interleave = 1;
};

// Names of every preset, in a stable order.
std::vector<std::string> preset_names();

// One line describing a preset (for `kvbridge presets`); empty if unknown.
std::string preset_summary(std::string_view name);

// Builds the layout of rank `tp_rank` of an instance. Returns kNotFound for an
// unknown name, kInvalidArgument naming the option for options the
// architecture cannot take (a TP size that does not divide the heads, a block
// size that is not a multiple of the kernel block, a state that does not fit
// the page). The result always passes validate().
Result<Layout> make_preset(const PresetOptions& options);

}  // namespace kvbridge

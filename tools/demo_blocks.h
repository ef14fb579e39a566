// tools/demo_blocks.h: what the demo's driver plays of an engine's block
// manager: pools of block ids per instance, and how many blocks a request
// of a side's layout needs.
//
// Thread-safety: none needed (the driver is single-threaded).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "demo.h"
#include "kvbridge/layout.h"

namespace kvbridge::cli::demo {

// The engine's block allocator, stand-in: one pool of ids per instance shared
// by its groups (overlaid groups never share an id), with double frees seen.
class BlockPool {
 public:
  explicit BlockPool(uint64_t n) {
    for (uint64_t b = 0; b < n; ++b) free_.push_back(static_cast<int64_t>(b));
  }
  std::optional<std::vector<int64_t>> allocate(uint64_t count, std::mt19937_64& rng) {
    if (count > free_.size()) return std::nullopt;
    std::vector<int64_t> ids;
    for (uint64_t i = 0; i < count; ++i) {
      // Mostly consecutive, as allocators hand out, with some jumps.
      const size_t at = rng() % 4 == 0 ? rng() % free_.size() : 0;
      ids.push_back(free_[at]);
      used_.insert(free_[at]);
      free_.erase(free_.begin() + static_cast<long>(at));
    }
    return ids;
  }
  void release(const std::vector<int64_t>& ids) {
    for (int64_t id : ids) {
      if (used_.erase(id) == 0) {
        ++double_frees_;
      } else {
        free_.push_back(id);
      }
    }
  }
  uint64_t in_use() const { return used_.size(); }
  uint64_t double_frees() const { return double_frees_; }

 private:
  std::deque<int64_t> free_;
  std::set<int64_t> used_;
  uint64_t double_frees_ = 0;
};

// An instance's pools: the blocks of the groups in the tensors of attention
// and sliding-window groups, and the slots of the state and scratch groups
// whose tensors are their own (state_pool_groups()), as SGLang keeps a mamba
// pool of a slot per running request beside its KV pool.
struct InstancePools {
  InstancePools(uint64_t blocks, uint64_t state_blocks) : blocks(blocks), state(state_blocks) {}
  BlockPool blocks, state;

  BlockPool& of(bool state_pool) { return state_pool ? state : blocks; }
  uint64_t in_use() const { return blocks.in_use() + state.in_use(); }
  uint64_t double_frees() const { return blocks.double_frees() + state.double_frees(); }
};

// A request's ids on one side, per pool.
struct HeldBlocks {
  std::vector<int64_t> blocks, state;

  std::vector<int64_t>& of(bool state_pool) { return state_pool ? state : blocks; }
  void release_to(InstancePools& pools) const {
    pools.blocks.release(blocks);
    pools.state.release(state);
  }
};

// Rank 0's layout of one side, state_blocks passed to the preset (0:
// num_blocks); errors name the side.
Result<Layout> layout_of(const DemoArgs& a, const SideArgs& s, uint64_t num_blocks, uint64_t state_blocks = 0);
// The names of the state and scratch groups none of whose tensors an
// attention or sliding-window group uses: their blocks are slots of the
// state pool.
std::set<std::string> state_pool_groups(const Layout& l);
// Blocks of group `g` (and of every transfer group of `l` in the state pool
// or not) that a request of `tokens` tokens holds.
uint64_t blocks_for(const Group& g, uint64_t tokens);
uint64_t blocks_per_request(const Layout& l, uint64_t tokens, bool state_pool);

// The pools a run of the demo needs: its longest request (--max-tokens, or
// from 1024 to 4096 tokens by the sides' block sizes), the blocks that
// request holds on either side (--num-blocks, checked against them) and the
// slots of the state pool, and rank 0's layout of each side over those pools.
struct PoolSizes {
  uint64_t max_tokens = 0;
  uint64_t num_blocks = 0;
  uint64_t state_blocks = 0;  // 0: no state pool
  Layout prefill, decode;
};
// kInvalidArgument naming the flag for --min-tokens or --num-blocks that no
// request could use.
Result<PoolSizes> size_pools(const DemoArgs& a);

}  // namespace kvbridge::cli::demo

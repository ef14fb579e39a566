// tools/store_bench.h: what `kvbridge store` shares between its subcommands:
// the options, a synthetic instance (every rank of a preset in this process,
// with its memory and RankStore), and the bench.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/host_memory.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/store.h"

namespace kvbridge::cli {

struct StoreArgs {
  std::string preset = "llama3-8b";
  uint32_t tp = 1;
  int64_t rank = -1;  // put: only this rank of the instance (its part), -1: every rank
  uint64_t block_tokens = 0;
  std::string order = "LBHNC";
  uint64_t hash_block_tokens = 16;
  uint64_t num_tokens = 1024;
  uint64_t token_seed = 1;
  uint64_t content_seed = 7;
  std::string redis;              // HOST:PORT
  std::string redis_cluster;      // HOST:PORT of a cluster node
  uint64_t redis_timeout_ms = 0;  // RedisOptions::command_timeout; 0: the library's
  std::string disk;               // disk tier directory
  uint64_t disk_mib = 8192;
  uint64_t memory_mib = 1024;
  bool json = false;
  // bench
  uint64_t bench_mib = 256;
  uint32_t repeat = 3;
  uint64_t lookup_tokens = 131072;
};

// A rank's tensors in HostMemory: zero until touched, so a request that
// uses a few blocks of tensors of hundreds of MiB (qwen3-next's states)
// does not pay to zero the rest.
struct RankMem {
  Layout layout;
  std::vector<HostMemory> bytes;
  std::vector<std::span<uint8_t>> spans;
  static Result<std::unique_ptr<RankMem>> create(Layout l);
  TensorMemory memory() { return TensorMemory(spans); }
};

struct GetCheck {
  uint64_t hit_tokens = 0, bytes_copied = 0, memory_objects = 0, disk_objects = 0, redis_objects = 0;
  uint64_t cells = 0, bad_cells = 0;
  std::string first_error;
};

// Every rank of an instance of a preset (or only args.rank when set), with
// memory for requests of up to max_tokens. Block ids start at 1; groups that
// overlay one tensor get disjoint id ranges.
struct SyntheticInstance {
  static Result<SyntheticInstance> create(std::shared_ptr<Store> store, const StoreArgs& args, uint64_t max_tokens);
  Request request(size_t rank, uint64_t num_tokens) const;
  // The content pattern of a request of num_tokens, and the states an
  // align-mode engine keeps at its earlier block boundaries.
  Status fill(uint64_t num_tokens, uint64_t seed);
  Result<PutResult> put(std::span<const uint32_t> tokens, uint64_t num_tokens);
  Result<GetCheck> get_and_check(std::span<const uint32_t> tokens, uint64_t num_tokens, uint64_t seed);
  // Checks the content of [0, hit_tokens) in every rank (stored groups only).
  Result<GetCheck> check(uint64_t hit_tokens, uint64_t seed);

  std::vector<std::unique_ptr<RankMem>> ranks;
  std::vector<RankStore> stores;
  int64_t stride = 0;
};

std::vector<uint32_t> synthetic_tokens(uint64_t seed, uint64_t n);

// HOST[:PORT] of --redis or --redis-cluster (`option`: cluster set for the
// latter). kInvalidArgument naming the option.
Result<RedisOptions> parse_redis(const std::string& spec, const std::string& option);

// `kvbridge store bench`: prints the rows (a JSON array with --json).
int run_store_bench(const StoreArgs& args);

}  // namespace kvbridge::cli

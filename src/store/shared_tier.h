// The shared tier as the store sees it: one Redis server (RedisTier) or a
// Redis Cluster (ClusterTier, which routes each key to the node of its slot).
// Every operation degrades to misses (or unwritten objects) with counted
// errors when the tier is down or failing: none returns an error to the
// store, none hangs (each bounded by the RedisOptions timeouts).
//
// Not a public header. Thread-safety: implementations are thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/store.h"
#include "kvbridge/store_key.h"

namespace kvbridge::store_internal {

struct RedisCounters {
  bool up = false;
  uint64_t writes = 0, parts = 0, errors = 0, skipped = 0;
  uint64_t redirects = 0;         // MOVED/ASK replies followed (cluster)
  uint64_t slot_map_updates = 0;  // slot maps read (cluster)
  uint32_t nodes = 0;             // masters serving slots (cluster; 1 otherwise)
  std::string last_error;         // "host:port: operation: cause" of the latest error; empty if none
};

// Where get() puts values. Every call comes from the thread that called get();
// the calls of one key are consecutive: buffer(), then received() for
// consecutive ranges from offset 0, then done() once, unless the operation
// fails first. Keys come in key order on one server; a cluster goes node by
// node.
class GetSink {
 public:
  virtual ~GetSink() = default;
  // The buffer for the value of key `i`, `bytes` long, or nullptr to drop it.
  // The buffer stays the caller's.
  virtual uint8_t* buffer(size_t i, uint64_t bytes) = 0;
  // buffer[offset, offset + n) of key `i` has arrived.
  virtual void received(size_t i, uint64_t offset, uint64_t n) = 0;
  // The whole value of key `i` is in its buffer.
  virtual void done(size_t i) = 0;
};

// One rank's part of an object, for put_parts().
struct PartWrite {
  std::string object_key;
  std::string staging_key;
  const uint8_t* object = nullptr;                        // object-sized; only the ranges below are read
  std::span<const std::pair<uint64_t, uint64_t>> ranges;  // [begin, end) object offsets
  uint64_t header_bytes = 0;                              // object[0, header_bytes) is written too
  uint64_t part_bit = 0;                                  // SETBIT offset of this part
  uint64_t bitmap_byte_begin = 0;                         // the bitmap's bytes, for BITCOUNT
  uint64_t bitmap_byte_end = 0;                           // inclusive
  uint32_t parts = 0;                                     // bits that make the object complete
};

enum class PartOutcome : uint8_t {
  kFailed,     // not written (Redis down or failing)
  kWritten,    // written; the object still lacks parts
  kPublished,  // written, and this part completed the object
  kPresent,    // the object existed already: nothing written
};

struct TierSize {
  uint64_t keys = 0;               // DBSIZE, summed over masters
  uint64_t used_memory_bytes = 0;  // INFO memory used_memory, summed over masters
};

class SharedTier {
 public:
  virtual ~SharedTier() = default;
  virtual const RedisOptions& options() const = 0;
  // The key of `key` in this tier (ObjectKey::text or cluster_text with the
  // options' prefix).
  virtual std::string key_of(const ObjectKey& key) const = 0;
  // SETs each value under its key. Returns how many were written.
  virtual size_t put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values) = 0;
  // Writes each part in its own transaction (redis_tier.h), pipelined.
  virtual std::vector<PartOutcome> put_parts(std::span<const PartWrite> parts) = 0;
  // Per key, 1 when it exists; 0 for absent keys and for keys whose node is
  // down or failing.
  virtual std::vector<uint8_t> exists(std::span<const std::string> keys) = 0;
  // GETs the keys into the sink's buffers. Returns false after a failure
  // (keys not reported done are misses; a value whose buffer was handed out
  // but not reported done is incomplete).
  virtual bool get(std::span<const std::string> keys, GetSink& sink) = 0;
  // Runs one command (for tools and tests: PTTL, GET, SET, DEBUG); on a
  // cluster, on the node of args[1]'s slot. The reply as text (integers in
  // decimal), or an error.
  virtual Result<std::string> command(std::span<const std::string> args) = 0;
  virtual Result<TierSize> size() = 0;
  virtual RedisCounters counters() const = 0;
};

}  // namespace kvbridge::store_internal

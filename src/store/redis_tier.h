// The shared tier: objects as Redis strings, one blocking hiredis connection
// with bounded connect and socket timeouts, `pipeline_depth` value-sized
// commands in flight.
//
// Reads: get() keeps a window of GET commands in flight and reads the replies
// from the socket itself, each value straight into a buffer the caller names
// (so a value is copied once, from the kernel into its final place), and
// reports the bytes as they arrive so the caller can checksum them while they
// are in cache.
//
// Writes: put() SETs whole objects; put_parts() writes one rank's part of an
// object (docs/formats/store-object.md, "Assembly in the shared tier"): the
// part's byte ranges and its bit in the object's part bitmap land in one
// MULTI/EXEC under a staging key with a TTL, and the transaction that
// completes the bitmap renames the staging key to the object key (a Lua
// script inside the transaction), so an object key only ever holds a whole
// object.
//
// Failure policy: any failure (refused, reset, timeout, an error reply, a
// protocol error) closes the connection, counts an error and marks the tier
// down for `retry_interval`; while down, operations return at once as misses
// (counted as skipped). So a Redis that dies or stalls costs at most one
// timeout per retry interval, never a hang. SIGPIPE from writing to a closed
// socket is blocked on the calling thread during I/O and discarded, so it
// cannot kill the process (hiredis writes with write(2), not
// send(MSG_NOSIGNAL)).
//
// Not a public header. Thread-safety: thread-safe (one mutex; one operation
// at a time on the connection).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvbridge/store.h"
#include "store/shared_tier.h"

struct redisContext;
struct iovec;

namespace kvbridge::store_internal {

// A reply that sends a key elsewhere (Redis Cluster): its slot moved to
// another node (MOVED: for good; ASK: for the next command, during a
// migration), or the cluster cannot serve it now (CLUSTERDOWN, TRYAGAIN:
// kRetry, no node).
struct Redirect {
  enum Kind : uint8_t { kMoved, kAsk, kRetry };
  size_t index = 0;  // of the key (or part) in the call
  Kind kind = kMoved;
  uint16_t slot = 0;
  std::string host;
  uint16_t port = 0;
  std::string reply;  // kRetry: the error reply (CLUSTERDOWN ..., TRYAGAIN ...)
};

// Parses an error reply's text ("MOVED 3999 127.0.0.1:6381", "ASK ...",
// "CLUSTERDOWN ...", "TRYAGAIN ..."); false for any other error.
bool parse_redirect(std::string_view error, Redirect* out);

// One slot range of CLUSTER SLOTS: [first, last] served by the master at
// host:port.
struct SlotRange {
  uint16_t first = 0, last = 0;
  std::string host;
  uint16_t port = 0;
};

class RedisTier final : public SharedTier {
 public:
  explicit RedisTier(RedisOptions options);
  ~RedisTier() override;
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  const RedisOptions& options() const override { return options_; }
  std::string key_of(const ObjectKey& key) const override { return key.text(options_.key_prefix); }

  // SETs each value under its key. Returns how many were written (all, or
  // fewer after a failure).
  size_t put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values) override {
    return put(keys, values, nullptr, false);
  }
  // Writes each part in its own transaction (see the file comment), pipelined.
  std::vector<PartOutcome> put_parts(std::span<const PartWrite> parts) override {
    return put_parts(parts, nullptr, false);
  }
  // Per key, 1 when it exists; 0 for absent keys and for all keys when the
  // tier is down or fails.
  std::vector<uint8_t> exists(std::span<const std::string> keys) override { return exists(keys, nullptr, false); }
  // GETs the keys into the sink's buffers. Returns false after a failure
  // (keys not reported done are misses; a value whose buffer was handed out
  // but not reported done is incomplete).
  bool get(std::span<const std::string> keys, GetSink& sink) override { return get(keys, sink, nullptr, false); }
  // Runs one command (for tools and tests: DBSIZE, INFO, PTTL). Returns the
  // reply as text (integers in decimal), or an error.
  Result<std::string> command(std::span<const std::string> args) override;
  Result<TierSize> size() override;
  RedisCounters counters() const override;

  // As a node of a cluster (ClusterTier): a key answered with a redirect is
  // listed in `redirects` (and is a miss, or not written, here) instead of
  // failing the connection; with `asking`, each command is preceded by
  // ASKING (the target of an ASK redirect). put_parts() lists a part whose
  // transaction was refused for a redirect (EXECABORT: nothing written).
  size_t put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values,
             std::vector<Redirect>* redirects, bool asking);
  std::vector<PartOutcome> put_parts(std::span<const PartWrite> parts, std::vector<Redirect>* redirects, bool asking);
  std::vector<uint8_t> exists(std::span<const std::string> keys, std::vector<Redirect>* redirects, bool asking);
  bool get(std::span<const std::string> keys, GetSink& sink, std::vector<Redirect>* redirects, bool asking);
  // CLUSTER SLOTS: the masters' slot ranges. kUnavailable when unreachable.
  Result<std::vector<SlotRange>> cluster_slots();
  // True when the node is marked down (within its retry interval).
  bool down() const;

 private:
  bool connect_locked();
  // Marks the connection failed: counts the error, records `what` and the
  // cause (io_error_, else hiredis's) as counters_.last_error, closes the
  // connection and skips operations for retry_interval.
  void fail_locked(const char* what);
  // fail_locked() for a reply that is an error or not what was expected.
  void fail_reply_locked(const char* what, std::string_view line);
  // Records why send/recv returned `n` (0: closed; -1: errno `err`).
  void io_failed_locked(ssize_t n, int err);
  // Socket I/O for get() and put(), which bypass hiredis: check that
  // hiredis holds no unread bytes; send all of `bytes` (or of the iovecs);
  // read into in_; read one "\r\n"-terminated line (returned without the
  // terminator).
  bool raw_ready_locked();
  bool send_all_locked(const std::string& bytes);
  bool send_iov_locked(::iovec* iov, int count);
  bool fill_locked();
  bool read_line_locked(std::string_view* line);
  // Reads `n` bytes of the reply (appended to `out` unless null).
  bool read_bytes_locked(uint64_t n, std::string* out);
  // Reads one RESP value and drops it, at most `depth` arrays deep.
  bool skip_value_locked(int depth);
  bool read_value_locked(size_t i, uint64_t bytes, GetSink& sink);

  RedisOptions options_;
  mutable std::mutex mu_;
  redisContext* ctx_ = nullptr;
  std::chrono::steady_clock::time_point down_until_{};
  RedisCounters counters_;
  // Requires mu_: `n` bytes (recv's result) of the operation's reply came;
  // false (io_error_ says why) for a failed recv or a reply too slow.
  bool received_locked(ssize_t n);
  std::string io_error_;  // why the last socket call failed; read by fail_locked()
  // The least rate of a reply once an operation is older than the command
  // timeout (a trickling server fails then).
  static constexpr uint64_t kMinReplyBytesPerSecond = uint64_t{1} << 20;
  std::chrono::steady_clock::time_point op_start_;  // of the operation under way (connect_locked())
  uint64_t op_bytes_ = 0;                           // received since op_start_
  // get()'s read buffer: [in_head_, in_tail_) is unread.
  std::vector<uint8_t> in_;
  size_t in_head_ = 0, in_tail_ = 0;
  std::string out_;
};

}  // namespace kvbridge::store_internal

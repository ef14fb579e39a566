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

#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/store.h"

struct redisContext;
struct iovec;

namespace kvbridge::store_internal {

struct RedisCounters {
  bool up = false;
  uint64_t writes = 0, parts = 0, errors = 0, skipped = 0;
};

// Where get() puts values. Every call comes from the thread that called get(),
// in key order; for one key: buffer(), then received() for consecutive ranges
// from offset 0, then done() once, unless the operation fails first.
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

class RedisTier {
 public:
  explicit RedisTier(RedisOptions options);
  ~RedisTier();
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  const RedisOptions& options() const { return options_; }

  // SETs each value under its key. Returns how many were written (all, or
  // fewer after a failure).
  size_t put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values);
  // Writes each part in its own transaction (see the file comment), pipelined.
  std::vector<PartOutcome> put_parts(std::span<const PartWrite> parts);
  // Per key, 1 when it exists; 0 for absent keys and for all keys when the
  // tier is down or fails.
  std::vector<uint8_t> exists(std::span<const std::string> keys);
  // GETs the keys into the sink's buffers. Returns false after a failure
  // (keys not reported done are misses; a value whose buffer was handed out
  // but not reported done is incomplete).
  bool get(std::span<const std::string> keys, GetSink& sink);
  // Runs one command (for tools and tests: DBSIZE, INFO, PTTL). Returns the
  // reply as text (integers in decimal), or an error.
  Result<std::string> command(std::span<const std::string> args);

  RedisCounters counters() const;

 private:
  bool connect_locked();
  void fail_locked(const char* what);
  // Socket I/O for get() and put(), which bypass hiredis: check that
  // hiredis holds no unread bytes; send all of `bytes` (or of the iovecs);
  // read into in_; read one "\r\n"-terminated line (returned without the
  // terminator).
  bool raw_ready_locked();
  bool send_all_locked(const std::string& bytes);
  bool send_iov_locked(::iovec* iov, int count);
  bool fill_locked();
  bool read_line_locked(std::string_view* line);
  bool read_value_locked(size_t i, uint64_t bytes, GetSink& sink);

  RedisOptions options_;
  mutable std::mutex mu_;
  redisContext* ctx_ = nullptr;
  std::chrono::steady_clock::time_point down_until_{};
  RedisCounters counters_;
  // get()'s read buffer: [in_head_, in_tail_) is unread.
  std::vector<uint8_t> in_;
  size_t in_head_ = 0, in_tail_ = 0;
  std::string out_;
};

}  // namespace kvbridge::store_internal

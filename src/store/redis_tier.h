// The shared tier: objects as Redis strings (SET/GET/EXISTS), one blocking
// hiredis connection with bounded connect and socket timeouts, pipelined
// `pipeline_depth` commands per round trip.
//
// Failure policy: any failure (refused, reset, timeout, an error reply) closes
// the connection, counts an error and marks the tier down for
// `retry_interval`; while down, operations return at once as misses (counted
// as skipped). So a Redis that dies or stalls costs at most one timeout per
// retry interval, never a hang. SIGPIPE from writing to a closed socket is
// blocked on the calling thread during I/O and discarded, so it cannot kill
// the process (hiredis writes with write(2), not send(MSG_NOSIGNAL)).
//
// Not a public header. Thread-safety: thread-safe (one mutex; one operation
// at a time on the connection).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/store.h"

struct redisContext;
struct redisReadTask;

namespace kvbridge::store_internal {

struct RedisCounters {
  bool up = false;
  uint64_t writes = 0, errors = 0, skipped = 0;
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
  // Per key, 1 when it exists; 0 for absent keys and for all keys when the
  // tier is down or fails.
  std::vector<uint8_t> exists(std::span<const std::string> keys);
  // GETs the keys; calls `found(i, bytes)` for each key present, in order,
  // on this thread, with bytes valid during the call. Returns false after a
  // failure (keys not reported are misses).
  bool get(std::span<const std::string> keys, const std::function<void(size_t, std::span<const uint8_t>)>& found);
  // Runs one command (for tools: DBSIZE, INFO, FLUSHDB). Returns the reply as
  // text (integers in decimal), or an error.
  Result<std::string> command(std::span<const std::string> args);

  RedisCounters counters() const;

 private:
  bool connect_locked();
  void fail_locked(const char* what);
  static void* create_string(const ::redisReadTask* task, char* str, size_t len);

  // While get() waits for a GET reply, the reply's bytes go straight to
  // `sink_` from hiredis's read buffer (see create_string), instead of into a
  // freshly allocated reply string that get() would copy again.
  std::function<void(std::span<const uint8_t>)> sink_;
  struct Functions;
  std::unique_ptr<Functions> functions_;

  RedisOptions options_;
  mutable std::mutex mu_;
  redisContext* ctx_ = nullptr;
  std::chrono::steady_clock::time_point down_until_{};
  RedisCounters counters_;
};

}  // namespace kvbridge::store_internal

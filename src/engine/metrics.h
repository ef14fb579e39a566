// engine/metrics.h: the engine's counters and latency histogram.
//
// Counters are atomics bumped on the transfer path without a lock; a
// snapshot may mix counts from just before and just after a completion, but
// each counter is exact once the engine is quiet. The Prometheus text is the
// text exposition format 0.0.4: counters end in "_total", the latency
// histogram is cumulative with "le" in seconds, and every name starts with
// "kvbridge_".
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "kvbridge/engine.h"

namespace kvbridge::engine_internal {

// The histogram bucket of a latency: bucket k < kLatencyBuckets - 1 holds
// latencies of at most 2^k microseconds (and more than 2^(k-1)); the last
// bucket holds everything longer.
size_t latency_bucket(std::chrono::nanoseconds latency);

class Metrics {
 public:
  void submitted(uint64_t descriptors) {
    transfers_submitted_.fetch_add(1, std::memory_order_relaxed);
    descriptors_.fetch_add(descriptors, std::memory_order_relaxed);
  }
  // Undoes submitted() for a transfer the table refused (shutting down).
  // Counted before the transfer starts, so a transfer that ends on the
  // submitting thread is never seen ended before it was submitted.
  void unsubmitted(uint64_t descriptors) {
    transfers_submitted_.fetch_sub(1, std::memory_order_relaxed);
    descriptors_.fetch_sub(descriptors, std::memory_order_relaxed);
  }
  // One call per transfer, when it ends; `bytes` are the bytes moved.
  void ended(TransferState state, TransferOp op, uint64_t bytes, std::chrono::nanoseconds latency);
  void notification_sent() { notifications_sent_.fetch_add(1, std::memory_order_relaxed); }
  void notification_received() { notifications_received_.fetch_add(1, std::memory_order_relaxed); }
  void content_checked(uint64_t bytes) { bytes_content_checked_.fetch_add(bytes, std::memory_order_relaxed); }
  void content_check_failed() { content_check_failures_.fetch_add(1, std::memory_order_relaxed); }
  void worker_woken() { worker_wakeups_.fetch_add(1, std::memory_order_relaxed); }

  EngineMetrics snapshot() const;
  std::string prometheus() const;

 private:
  std::atomic<uint64_t> transfers_submitted_{0}, transfers_done_{0}, transfers_failed_{0}, transfers_cancelled_{0};
  std::atomic<uint64_t> descriptors_{0}, bytes_read_{0}, bytes_written_{0};
  std::atomic<uint64_t> notifications_sent_{0}, notifications_received_{0};
  std::atomic<uint64_t> bytes_content_checked_{0}, content_check_failures_{0};
  std::atomic<uint64_t> worker_wakeups_{0};
  std::array<std::atomic<uint64_t>, kLatencyBuckets> latency_buckets_{};
  std::atomic<uint64_t> latency_sum_ns_{0};
};

// The text exposition of `m`; `latency_sum_seconds` fills the histogram's _sum.
std::string to_prometheus(const EngineMetrics& m, double latency_sum_seconds);

}  // namespace kvbridge::engine_internal

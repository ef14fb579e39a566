// Metrics: counters, the latency histogram, and their Prometheus text.
#include "engine/metrics.h"

#include <cstdio>

namespace kvbridge::engine_internal {

size_t latency_bucket(std::chrono::nanoseconds latency) {
  const int64_t ns = latency.count();
  for (size_t k = 0; k + 1 < kLatencyBuckets; ++k) {
    if (ns <= (int64_t{1} << k) * 1000) return k;
  }
  return kLatencyBuckets - 1;
}

void Metrics::ended(TransferState state, TransferOp op, uint64_t bytes, std::chrono::nanoseconds latency) {
  switch (state) {
    case TransferState::kDone:
      transfers_done_.fetch_add(1, std::memory_order_relaxed);
      break;
    case TransferState::kFailed:
      transfers_failed_.fetch_add(1, std::memory_order_relaxed);
      break;
    case TransferState::kCancelled:
      transfers_cancelled_.fetch_add(1, std::memory_order_relaxed);
      break;
    case TransferState::kInProgress:
      return;
  }
  (op == TransferOp::kRead ? bytes_read_ : bytes_written_).fetch_add(bytes, std::memory_order_relaxed);
  latency_buckets_[latency_bucket(latency)].fetch_add(1, std::memory_order_relaxed);
  latency_sum_ns_.fetch_add(static_cast<uint64_t>(latency.count()), std::memory_order_relaxed);
}

EngineMetrics Metrics::snapshot() const {
  EngineMetrics m;
  m.transfers_submitted = transfers_submitted_.load(std::memory_order_relaxed);
  m.transfers_done = transfers_done_.load(std::memory_order_relaxed);
  m.transfers_failed = transfers_failed_.load(std::memory_order_relaxed);
  m.transfers_cancelled = transfers_cancelled_.load(std::memory_order_relaxed);
  m.descriptors = descriptors_.load(std::memory_order_relaxed);
  m.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  m.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  m.notifications_sent = notifications_sent_.load(std::memory_order_relaxed);
  m.notifications_received = notifications_received_.load(std::memory_order_relaxed);
  m.bytes_content_checked = bytes_content_checked_.load(std::memory_order_relaxed);
  m.content_check_failures = content_check_failures_.load(std::memory_order_relaxed);
  m.worker_wakeups = worker_wakeups_.load(std::memory_order_relaxed);
  for (size_t k = 0; k < kLatencyBuckets; ++k)
    m.latency_us_buckets[k] = latency_buckets_[k].load(std::memory_order_relaxed);
  return m;
}

std::string Metrics::prometheus() const {
  return to_prometheus(snapshot(), static_cast<double>(latency_sum_ns_.load(std::memory_order_relaxed)) * 1e-9);
}

std::string to_prometheus(const EngineMetrics& m, double latency_sum_seconds) {
  std::string out;
  auto counter = [&](const char* name, const char* help, uint64_t value) {
    out += std::string("# HELP kvbridge_") + name + " " + help + "\n";
    out += std::string("# TYPE kvbridge_") + name + " counter\n";
    out += std::string("kvbridge_") + name + " " + std::to_string(value) + "\n";
  };
  out += "# HELP kvbridge_transfers_total Transfers by outcome (submitted counts every accepted submit).\n";
  out += "# TYPE kvbridge_transfers_total counter\n";
  out += "kvbridge_transfers_total{state=\"submitted\"} " + std::to_string(m.transfers_submitted) + "\n";
  out += "kvbridge_transfers_total{state=\"done\"} " + std::to_string(m.transfers_done) + "\n";
  out += "kvbridge_transfers_total{state=\"failed\"} " + std::to_string(m.transfers_failed) + "\n";
  out += "kvbridge_transfers_total{state=\"cancelled\"} " + std::to_string(m.transfers_cancelled) + "\n";
  counter("descriptors_total", "Descriptors (transfer items) submitted.", m.descriptors);
  out += "# HELP kvbridge_bytes_total Bytes moved by completed transfers, by direction.\n";
  out += "# TYPE kvbridge_bytes_total counter\n";
  out += "kvbridge_bytes_total{op=\"read\"} " + std::to_string(m.bytes_read) + "\n";
  out += "kvbridge_bytes_total{op=\"write\"} " + std::to_string(m.bytes_written) + "\n";
  counter("notifications_sent_total", "Notifications acknowledged by peers.", m.notifications_sent);
  counter("notifications_received_total", "Notifications received from peers.", m.notifications_received);
  counter("content_checked_bytes_total", "Bytes whose content check (verify_content) matched on both sides.",
          m.bytes_content_checked);
  counter("content_check_failures_total", "Runs whose bytes differed from the peer's under the content check.",
          m.content_check_failures);
  counter("worker_wakeups_total", "Times a submit woke the engine's sleeping threads for its chunks.",
          m.worker_wakeups);
  out += "# HELP kvbridge_transfer_latency_seconds Time from submit to the end of a transfer.\n";
  out += "# TYPE kvbridge_transfer_latency_seconds histogram\n";
  uint64_t cumulative = 0;
  char le[32];
  for (size_t k = 0; k + 1 < kLatencyBuckets; ++k) {
    cumulative += m.latency_us_buckets[k];
    std::snprintf(le, sizeof(le), "%g", static_cast<double>(uint64_t{1} << k) * 1e-6);
    out +=
        std::string("kvbridge_transfer_latency_seconds_bucket{le=\"") + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  cumulative += m.latency_us_buckets[kLatencyBuckets - 1];
  out += "kvbridge_transfer_latency_seconds_bucket{le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  std::snprintf(le, sizeof(le), "%.9g", latency_sum_seconds);
  out += std::string("kvbridge_transfer_latency_seconds_sum ") + le + "\n";
  out += "kvbridge_transfer_latency_seconds_count " + std::to_string(cumulative) + "\n";
  return out;
}

}  // namespace kvbridge::engine_internal

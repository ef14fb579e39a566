// Metrics: histogram buckets and the Prometheus text.
#include <gtest/gtest.h>

#include "engine/metrics.h"

namespace kvbridge::engine_internal {
namespace {

using std::chrono::microseconds;

TEST(MetricsTest, LatencyBucketsArePowersOfTwoMicroseconds) {
  EXPECT_EQ(latency_bucket(std::chrono::nanoseconds(10)), 0u);
  EXPECT_EQ(latency_bucket(microseconds(1)), 0u);
  EXPECT_EQ(latency_bucket(microseconds(2)), 1u);
  EXPECT_EQ(latency_bucket(microseconds(3)), 2u);
  EXPECT_EQ(latency_bucket(microseconds(1 << 14)), 14u);
  EXPECT_EQ(latency_bucket(microseconds((1 << 14) + 1)), kLatencyBuckets - 1);
  EXPECT_EQ(latency_bucket(std::chrono::seconds(100)), kLatencyBuckets - 1);
}

TEST(MetricsTest, CountsEachEndOnceByStateAndDirection) {
  Metrics m;
  m.submitted(3);
  m.submitted(1);
  m.ended(TransferState::kDone, TransferOp::kRead, 100, microseconds(5));
  m.ended(TransferState::kFailed, TransferOp::kWrite, 7, microseconds(50));
  m.notification_sent();
  EngineMetrics s = m.snapshot();
  EXPECT_EQ(s.transfers_submitted, 2u);
  EXPECT_EQ(s.descriptors, 4u);
  EXPECT_EQ(s.transfers_done, 1u);
  EXPECT_EQ(s.transfers_failed, 1u);
  EXPECT_EQ(s.bytes_read, 100u);
  EXPECT_EQ(s.bytes_written, 7u);
  EXPECT_EQ(s.notifications_sent, 1u);
  EXPECT_EQ(s.latency_us_buckets[3], 1u);
  EXPECT_EQ(s.latency_us_buckets[6], 1u);
}

TEST(MetricsTest, PrometheusTextIsPrefixedAndCumulative) {
  Metrics m;
  m.ended(TransferState::kDone, TransferOp::kRead, 10, microseconds(1));
  m.ended(TransferState::kDone, TransferOp::kRead, 10, microseconds(3));
  const std::string text = m.prometheus();
  EXPECT_NE(text.find("kvbridge_transfers_total{state=\"done\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvbridge_bytes_total{op=\"read\"} 20\n"), std::string::npos);
  EXPECT_NE(text.find("kvbridge_transfer_latency_seconds_bucket{le=\"1e-06\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvbridge_transfer_latency_seconds_bucket{le=\"4e-06\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvbridge_transfer_latency_seconds_bucket{le=\"+Inf\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvbridge_transfer_latency_seconds_count 2\n"), std::string::npos);
  for (size_t pos = 0; pos < text.size();) {
    const size_t end = text.find('\n', pos);
    const std::string line = text.substr(pos, end - pos);
    if (line[0] != '#') {
      EXPECT_EQ(line.rfind("kvbridge_", 0), 0u) << line;
    }
    pos = end + 1;
  }
}

}  // namespace
}  // namespace kvbridge::engine_internal

// The conformance and fault suites over device memory, on the host fake
// (KVB_DEVICE=fake, set for conformance_test by CMakeLists.txt): cuda_ipc
// with the peer's buffer in another process's fake device memory, and the
// local transport with the peer's buffer in this process's. The engine under
// test's own buffer is host memory, so these are device-to-host reads and
// host-to-device writes through the same batched device path as
// device-to-device.
#include "conformance/conformance.h"
#include "conformance/pattern.h"
#include "device/device.h"

#include <chrono>
#include <thread>

namespace kvbridge::conformance {

class DeviceConformance : public ConformanceBase {};

// A peer that deregisters its device memory, frees it and registers a new
// allocation (often at the same address) is read afresh: the importer never
// reads through the mapping of the freed allocation (whose bytes the old
// mapping would still show), and the old region is gone.
TEST_P(DeviceConformance, MemoryRegisteredAgainIsReadFreshNeverThroughAStaleMapping) {
  const TransferItem first = item(0, 0, kBytes);
  TransferStatus st = run(TransferOp::kRead, {first});
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  ASSERT_EQ(find_mismatch(local_.data(), kBytes, kPeerSeed, 0), -1);

  const RegionId old_region = peer_->region();
  const Status again_status = peer_->reregister(9);
  ASSERT_TRUE(again_status.ok()) << again_status.to_string();
  Result<PeerId> again = engine_->connect(peer_->metadata());
  ASSERT_TRUE(again.ok()) << again.error().to_string();
  EXPECT_EQ(*again, peer_id_) << "the same engine keeps its peer id";
  st = run(TransferOp::kRead, {item(0, 0, kBytes)});
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(find_mismatch(local_.data(), kBytes, 9, 0), -1) << "read the freed allocation through a stale mapping";

  const TransferItem stale{local_region_, 0, old_region, 0, 4096};
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, {&stale, 1});
  ASSERT_FALSE(id.ok()) << "the old region still resolves";
  EXPECT_EQ(id.error().code(), Code::kNotFound) << id.error().to_string();
}

// A peer that exits has its allocations closed by the importer at once (a
// mapping of a dead process's memory would keep that GPU memory allocated),
// and the next transfer fails naming it.
TEST_P(DeviceConformance, APeerThatExitsHasItsMappingsClosedAtOnce) {
  if (GetParam().transport != "cuda_ipc") GTEST_SKIP() << "only cuda_ipc maps another process's memory";
  ASSERT_EQ(device::fake_opened_count(), 0u);
  TransferStatus st = run(TransferOp::kRead, {item(0, 0, 4096)});
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(device::fake_opened_count(), 1u) << "the peer's allocation is open once";
  peer_->kill();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (device::fake_opened_count() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(device::fake_opened_count(), 0u) << "the dead peer's allocation is still mapped";
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, std::vector<TransferItem>{item(0, 0, 4096)});
  if (id.ok()) {
    st = engine_->wait(*id, std::chrono::seconds(10));
    EXPECT_EQ(st.state, TransferState::kFailed);
    EXPECT_NE(st.error.message().find("peer-a"), std::string::npos) << st.error.to_string();
  } else {
    EXPECT_NE(id.error().message().find("peer-a"), std::string::npos) << id.error().to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(CudaIpc, DeviceConformance,
                         ::testing::Values(ConformanceParam{"cuda_ipc_child", "cuda_ipc", true, "cuda:0"},
                                           ConformanceParam{"local_device", "local", false, "cuda:0"}),
                         conformance_name);

INSTANTIATE_TEST_SUITE_P(CudaIpc, TransportConformance,
                         ::testing::Values(ConformanceParam{"cuda_ipc_child", "cuda_ipc", true, "cuda:0"},
                                           ConformanceParam{"local_device", "local", false, "cuda:0"}),
                         conformance_name);
INSTANTIATE_TEST_SUITE_P(CudaIpc, FaultInjection,
                         ::testing::Values(ConformanceParam{"cuda_ipc_child", "cuda_ipc", true, "cuda:0"},
                                           ConformanceParam{"local_device", "local", false, "cuda:0"}),
                         conformance_name);

}  // namespace kvbridge::conformance

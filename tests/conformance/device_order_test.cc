// Devices named by UUID across processes whose visible-device orders
// differ (as with different CUDA_VISIBLE_DEVICES), on the host fake
// (KVB_DEVICE=fake): the exporter sees the fake's devices as 1,0, this
// process as 0,1. Reading the exporter's cuda:1 (physical device 0) into
// host memory copies on this process's device 0, the same GPU, and makes
// no context on device 1, which nothing here asked about. (Its own binary:
// which devices have a context is the whole process's.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "conformance/harness.h"
#include "conformance/pattern.h"
#include "device/device.h"
#include "kvbridge/engine.h"

namespace kvbridge::conformance {
namespace {

TEST(DeviceOrderTest, AReadIntoHostMemoryRunsOnTheExportersDeviceNamedByUuid) {
  device::Device& d = device::current();
  ASSERT_EQ(d.name(), "fake") << "device_order_test runs with KVB_DEVICE=fake (CMakeLists.txt)";
  const std::string physical0 = *d.uuid(0);  // this process's order is fixed from here
  ASSERT_EQ(::setenv("KVB_FAKE_VISIBLE_DEVICES", "1,0", 1), 0);
  PeerOptions po;
  po.transport = "cuda_ipc";
  po.memory = "cuda:1";
  po.bytes = 1 << 20;
  Result<std::unique_ptr<Peer>> peer = make_child_peer(po);
  ::unsetenv("KVB_FAKE_VISIBLE_DEVICES");
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();

  EngineOptions o;
  o.name = "reader";
  o.transports = {"cuda_ipc"};
  Result<std::unique_ptr<Engine>> engine = Engine::create(o);
  ASSERT_TRUE(engine.ok()) << engine.error().to_string();
  std::vector<uint8_t> host(po.bytes, 0);
  Result<RegionId> mine = (*engine)->register_memory(host.data(), host.size(), "host");
  ASSERT_TRUE(mine.ok()) << mine.error().to_string();
  Result<PeerId> id = (*engine)->connect((*peer)->metadata());
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  const TransferItem all{*mine, 0, (*peer)->region(), 0, po.bytes};
  Result<TransferId> t = (*engine)->submit(*id, TransferOp::kRead, {&all, 1});
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  const TransferStatus st = (*engine)->wait(*t, std::chrono::seconds(10));
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(find_mismatch(host.data(), po.bytes, po.seed, 0), -1);
  EXPECT_TRUE(device::fake_context_on(0)) << "the exporter's device "
                                          << "is this process's device 0";
  EXPECT_FALSE(device::fake_context_on(1)) << "a context on a device nothing here asked about";
  EXPECT_EQ(*device::ordinal_of(d, physical0), 0);
}

}  // namespace
}  // namespace kvbridge::conformance

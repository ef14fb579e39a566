// tests/conformance/conformance.h: one conformance suite for every transport.
//
// TransportConformance (conformance_test.cc) and FaultInjection
// (fault_test.cc) are value-parameterized over a ConformanceParam. To run
// them against a transport, add one line in a .cc file of the
// conformance_test binary (see instantiate_local.cc and CMakeLists.txt):
//
//   INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance,
//       ::testing::Values(ConformanceParam{"tcp_child", "tcp", true}), conformance_name);
//
// The engine under test lives in the test process and reaches the peer
// through `transport`, wrapped in the fault transport (transport/fault.h):
// with no fault armed it passes every run through, and cases that need a
// slow link (cancel, deadline, peer gone mid-transfer) arm a delay. The peer
// runs in this process (child_peer false: required for "local") or in a
// peer_main child (true: required for "cma"; a real kill for "peer gone").
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "conformance/harness.h"
#include "kvbridge/engine.h"
#include "transport/fault/fault.h"

namespace kvbridge {
inline void PrintTo(TransferState s, std::ostream* os) { *os << transfer_state_name(s); }
}  // namespace kvbridge

namespace kvbridge::conformance {

struct ConformanceParam {
  std::string name;       // the instantiation's suffix, [A-Za-z0-9_]
  std::string transport;  // "local", "cma", "tcp", "ucx", "cuda_ipc"
  bool child_peer = false;
  std::string peer_memory = "host";  // or "cuda:0": the host fake's device memory
};

inline void PrintTo(const ConformanceParam& p, std::ostream* os) {
  *os << p.name << " (transport " << p.transport
      << (p.child_peer ? ", peer in a child process)" : ", peer in process)");
}

std::string conformance_name(const ::testing::TestParamInfo<ConformanceParam>& info);

class ConformanceBase : public ::testing::TestWithParam<ConformanceParam> {
 protected:
  static constexpr uint64_t kBytes = uint64_t{8} << 20;
  static constexpr uint32_t kPeerSeed = 7;
  static constexpr auto kWaitLimit = std::chrono::seconds(60);

  void SetUp() override;
  void TearDown() override;

  Result<std::unique_ptr<Peer>> start_peer(const std::string& name, uint32_t seed = kPeerSeed);
  // Submits and waits (failing the test if it does not end in kWaitLimit).
  TransferStatus run(TransferOp op, const std::vector<TransferItem>& items, std::string notification = {},
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // The ucx transport with UCX_TLS=shm: no transport that detects a dead
  // peer, the peer's process watched instead (its exit noticed, not its
  // effect on UCX's shared memory queues).
  bool ucx_over_shared_memory_only() const {
    const char* tls = std::getenv("UCX_TLS");
    return GetParam().transport == "ucx" && tls != nullptr && std::string_view(tls) == "shm";
  }
  // Waits until a transfer has moved some bytes (the slow link is mid-way).
  ::testing::AssertionResult await_progress(TransferId id);
  TransferItem item(uint64_t local_offset, uint64_t remote_offset, uint64_t bytes) const {
    return TransferItem{local_region_, local_offset, peer_->region(), remote_offset, bytes};
  }

  std::shared_ptr<transport::Faults> faults_;
  std::unique_ptr<Engine> engine_;
  std::vector<uint8_t> local_;  // registered as local_region_, zero at start
  RegionId local_region_ = 0;
  std::unique_ptr<Peer> peer_;
  PeerId peer_id_ = 0;
};

class TransportConformance : public ConformanceBase {};
class FaultInjection : public ConformanceBase {};

}  // namespace kvbridge::conformance

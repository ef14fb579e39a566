// The shared fixture of the conformance suites.
#include "conformance/conformance.h"

#include <thread>

#include "engine/engine_impl.h"
#include "testing/require.h"

namespace kvbridge::conformance {

std::string conformance_name(const ::testing::TestParamInfo<ConformanceParam>& info) { return info.param.name; }

void ConformanceBase::SetUp() {
  faults_ = std::make_shared<transport::Faults>();
  EngineOptions options;
  options.name = "engine-under-test";
  options.transports = {GetParam().transport};
  std::vector<TransportReport> reports;
  Result<std::vector<std::unique_ptr<transport::Transport>>> made = engine_internal::make_transports(options, &reports);
  if (!made.ok() && made.error().code() == Code::kUnavailable) {
    KVB_SKIP_UNLESS_REQUIRED(GetParam().transport,
                             "transport '" + GetParam().transport + "' cannot run here: " + made.error().message());
  }
  ASSERT_TRUE(made.ok()) << made.error().to_string();
  std::vector<std::unique_ptr<transport::Transport>> wrapped;
  for (auto& t : *made) wrapped.push_back(transport::make_fault_transport(std::move(t), faults_));
  engine_internal::EngineHooks hooks;
  hooks.drop_notification = [f = faults_](std::string_view m) { return f->take_notification_drop(m); };
  Result<std::unique_ptr<Engine>> engine =
      engine_internal::create_engine(options, std::move(wrapped), std::move(reports), std::move(hooks));
  ASSERT_TRUE(engine.ok()) << engine.error().to_string();
  engine_ = std::move(*engine);
  local_.assign(kBytes, 0);
  Result<RegionId> region = engine_->register_memory(local_.data(), local_.size());
  ASSERT_TRUE(region.ok()) << region.error().to_string();
  local_region_ = *region;
  Result<std::unique_ptr<Peer>> peer = start_peer("peer-a");
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();
  peer_ = std::move(*peer);
  Result<PeerId> id = engine_->connect(peer_->metadata());
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  peer_id_ = *id;
}

void ConformanceBase::TearDown() {
  engine_.reset();
  peer_.reset();
}

Result<std::unique_ptr<Peer>> ConformanceBase::start_peer(const std::string& name, uint32_t seed) {
  PeerOptions o;
  o.name = name;
  o.transport = GetParam().transport;
  o.bytes = kBytes;
  o.seed = seed;
  o.memory = GetParam().peer_memory;
  return GetParam().child_peer ? make_child_peer(o) : make_in_process_peer(o);
}

TransferStatus ConformanceBase::run(TransferOp op, const std::vector<TransferItem>& items, std::string notification,
                                    std::chrono::milliseconds timeout) {
  Result<TransferId> id = engine_->submit(peer_id_, op, items, std::move(notification), timeout);
  if (!id.ok()) {
    ADD_FAILURE() << "submit failed: " << id.error().to_string();
    TransferStatus st;
    st.state = TransferState::kFailed;
    st.error = id.error();
    return st;
  }
  TransferStatus st = engine_->wait(*id, kWaitLimit);
  EXPECT_NE(st.state, TransferState::kInProgress) << "transfer " << *id << " did not end within 60 s";
  EXPECT_TRUE(engine_->release(*id).ok() || st.state == TransferState::kInProgress);
  return st;
}

::testing::AssertionResult ConformanceBase::await_progress(TransferId id) {
  const auto deadline = std::chrono::steady_clock::now() + kWaitLimit;
  while (std::chrono::steady_clock::now() < deadline) {
    TransferStatus st = engine_->status(id);
    if (st.state != TransferState::kInProgress) {
      return ::testing::AssertionFailure() << "transfer ended (" << transfer_state_name(st.state) << ", "
                                           << st.error.to_string() << ") before it was observed mid-way";
    }
    if (st.bytes_done > 0) return ::testing::AssertionSuccess();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return ::testing::AssertionFailure() << "transfer " << id << " moved no byte within 60 s";
}

}  // namespace kvbridge::conformance

// The Link conformance suite's fixture and its link_peer child (see
// link_harness.h).
#include "conformance/link/link_harness.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/bytes.h"
#include "conformance/pattern.h"
#include "testing/link_run.h"
#include "testing/peer_info.h"
#include "testing/require.h"

#ifndef KVB_LINK_PEER
#error "KVB_LINK_PEER must name the link_peer binary (CMakeLists.txt defines it)"
#endif

namespace kvbridge::conformance {

using transport::Clock;
using transport::Copy;
using transport::RunControl;
using namespace std::chrono_literals;

std::string link_param_name(const ::testing::TestParamInfo<LinkParam>& info) { return info.param.name; }

// --- LinkPeer ---------------------------------------------------------------

Result<std::unique_ptr<LinkPeer>> LinkPeer::start(const std::string& transport, uint64_t bytes, uint32_t seed) {
  // A killed child makes writes to its stdin raise SIGPIPE; command() should
  // see an error instead.
  ::signal(SIGPIPE, SIG_IGN);
  SpawnOptions options;
  options.pipe_stdin = true;
  options.pipe_stdout = true;
  options.inherit_stderr = true;  // UCX's errors, and link_peer's usage
  KVB_ASSIGN_OR_RETURN(std::unique_ptr<ChildProcess> child,
                       ChildProcess::spawn({KVB_LINK_PEER, "--transport", transport, "--bytes", std::to_string(bytes),
                                            "--seed", std::to_string(seed)},
                                           options));
  const std::string ready = child->read_line(30s);
  std::istringstream in(ready);
  std::string word, address_hex, key_hex;
  auto peer = std::unique_ptr<LinkPeer>(new LinkPeer());
  in >> word;
  if (word == "error") {
    return Status::unavailable("link_peer could not offer " + transport + ": " + ready.substr(6));
  }
  in >> address_hex >> key_hex >> peer->base_ >> peer->pid_;
  if (word != "ready" || !in) {
    return Status::io_error("link_peer (" + transport +
                            ") did not report ready (it exited, or 30 s passed): it printed '" + ready + "'");
  }
  peer->child_ = std::move(child);
  peer->address_ = from_hex(address_hex);
  peer->key_ = from_hex(key_hex);
  peer->bytes_ = bytes;
  peer->memory_ = link_memory(transport);
  return peer;
}

LinkPeer::~LinkPeer() {
  if (killed_ || !child_) return;
  // A clean exit (UCX tears its worker down); the ChildProcess stops it
  // by signal when it does not go within the grace.
  if (command("exit").ok()) child_->wait(5s);
}

transport::PeerInfo LinkPeer::info(const std::string& name) const {
  return testing::peer_on_this_host(name, pid_, address_, {kLinkSegment, base_, bytes_, key_, memory_});
}

Result<std::string> LinkPeer::command(const std::string& line) {
  if (killed_) return Status::unavailable("link_peer (pid " + std::to_string(pid_) + ") was killed");
  const std::string out = line + "\n";
  for (size_t sent = 0; sent < out.size();) {
    const ssize_t n = ::write(child_->stdin_fd(), out.data() + sent, out.size() - sent);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::io_error("link_peer: cannot send '" + line + "': " + std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
  std::string answer = child_->read_line(60s);
  if (answer.empty()) return Status::io_error("link_peer did not answer '" + line + "' within 60 s");
  return answer;
}

::testing::AssertionResult LinkPeer::check(uint64_t offset, uint64_t len, uint32_t seed, uint64_t from) {
  Result<std::string> answer = command("check " + std::to_string(offset) + " " + std::to_string(len) + " " +
                                       std::to_string(seed) + " " + std::to_string(from));
  if (!answer.ok()) return ::testing::AssertionFailure() << answer.error().to_string();
  if (*answer == "ok") return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the peer's bytes [" << offset << ", " << offset + len << "): " << *answer;
}

Status LinkPeer::fill(uint64_t offset, uint64_t len, uint32_t seed) {
  KVB_ASSIGN_OR_RETURN(std::string answer, command("fill " + std::to_string(offset) + " " + std::to_string(len) + " " +
                                                   std::to_string(seed)));
  return answer == "ok" ? Status() : Status::internal("link_peer: " + answer);
}

Result<uint64_t> LinkPeer::count(uint64_t offset, uint64_t len, uint8_t value) {
  KVB_ASSIGN_OR_RETURN(std::string answer, command("count " + std::to_string(offset) + " " + std::to_string(len) + " " +
                                                   std::to_string(value)));
  uint64_t n = 0;
  if (std::sscanf(answer.c_str(), "count %lu", &n) != 1) return Status::internal("link_peer: " + answer);
  return n;
}

void LinkPeer::kill() {
  if (killed_) return;
  child_->signal(SIGKILL);
  child_->wait(10s);
  killed_ = true;
}

// --- Outcome ------------------------------------------------------------------

void Outcome::set(Status s) {
  std::lock_guard lock(mu_);
  ++calls_;
  if (!status_) {
    status_ = std::move(s);
    ended_ = Clock::now();
  }
  cv_.notify_all();
}

std::optional<Status> Outcome::wait(std::chrono::milliseconds limit) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, limit, [&] { return status_.has_value(); });
  return status_;
}

int Outcome::calls() {
  std::lock_guard lock(mu_);
  return calls_;
}

Clock::time_point Outcome::ended() {
  std::lock_guard lock(mu_);
  return ended_;
}

// --- the fixture ----------------------------------------------------------------

void LinkConformance::SetUp() {
  const LinkParam& p = GetParam();
  // What KVB_REQUIRE names: the transport, whatever memory it stages.
  const std::string family = p.transport.rfind("ucx", 0) == 0   ? "ucx"
                             : p.transport.rfind("tcp", 0) == 0 ? "tcp"
                                                                : p.transport;
  Result<std::unique_ptr<transport::Transport>> t = make_link_transport(p.transport);
  if (!t.ok()) KVB_SKIP_UNLESS_REQUIRED(family, p.transport + " cannot run here: " + t.error().to_string());
  transport_ = std::move(*t);
  Result<std::unique_ptr<LinkPeer>> peer = LinkPeer::start(p.transport, kBytes, kPeerSeed);
  if (!peer.ok() && peer.error().code() == Code::kUnavailable)
    KVB_SKIP_UNLESS_REQUIRED(family, peer.error().to_string());
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();
  peer_ = std::move(*peer);
  const std::string memory = local_link_memory(p.transport);
  Result<PeerBuffer> local = PeerBuffer::create(kBytes, memory);
  ASSERT_TRUE(local.ok()) << local.error().to_string();
  local_memory_ = std::move(*local);
  local_ = std::span<uint8_t>(local_memory_.data(), kBytes);
  if (memory != "host") {
    Result<std::string> key =
        transport_->add_segment(transport::Segment{kLocalSegment, local_memory_.data(), kBytes, memory, 3});
    ASSERT_TRUE(key.ok()) << key.error().to_string();
  }
  Result<std::unique_ptr<transport::Link>> link = transport_->connect(peer_->info(peer_name()));
  // cma's permission is known only per pair of processes (the kernel's
  // ptrace check, cma.cc): a refused probe is this machine, not the link.
  if (!link.ok() && p.transport == "cma" && link.error().code() == Code::kUnavailable)
    KVB_SKIP_UNLESS_REQUIRED(p.transport, "cma cannot reach its child here: " + link.error().to_string());
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  link_ = std::move(*link);
  if (p.path == RunPath::kStart) {
    ASSERT_TRUE(link_->runs_async()) << p.name << " drives runs with start(), but this " << p.transport
                                     << " link says runs_async() is false";
  }
}

void LinkConformance::TearDown() {
  link_.reset();
  std::lock_guard lock(outcomes_mu_);
  for (const std::shared_ptr<Outcome>& o : outcomes_) {
    EXPECT_EQ(o->calls(), 1) << "a start()'s done fired " << o->calls() << " times, not exactly once";
  }
  transport_.reset();
  peer_.reset();
}

LinkConformance::Flight::~Flight() {
  if (thread_.joinable() || (outcome_ && !outcome_->wait(0ms))) (void)wait();
}

Status LinkConformance::Flight::wait() {
  std::optional<Status> s = outcome_->wait(kWaitLimit);
  if (!s) {
    // The run still holds its copies and control: returning would leave it
    // writing into freed memory.
    ADD_FAILURE() << "a run did not end within " << kWaitLimit.count() << " s";
    std::fprintf(stderr, "link conformance: a run did not end within %lld s; aborting\n",
                 static_cast<long long>(kWaitLimit.count()));
    std::abort();
  }
  if (thread_.joinable()) thread_.join();
  return *s;
}

std::unique_ptr<LinkConformance::Flight> LinkConformance::launch(TransferOp op, std::span<const Copy> copies,
                                                                 RunControl& control) {
  auto flight = std::make_unique<Flight>();
  auto outcome = std::make_shared<Outcome>();
  flight->outcome_ = outcome;
  if (GetParam().path == RunPath::kRun) {
    flight->thread_ =
        std::thread([this, op, copies, &control, outcome] { outcome->set(link_->run(op, copies, control)); });
  } else {
    {
      std::lock_guard lock(outcomes_mu_);
      outcomes_.push_back(outcome);
    }
    link_->start(op, copies, control, [outcome](Status s) { outcome->set(std::move(s)); });
  }
  return flight;
}

Status LinkConformance::run(TransferOp op, const std::vector<Copy>& copies, std::chrono::milliseconds timeout) {
  if (GetParam().path == RunPath::kRun) return kvbridge::testing::run_link(*link_, op, copies, timeout);
  RunControl control;
  control.deadline = Clock::now() + timeout;
  const Status s = launch(op, copies, control)->wait();
  if (s.ok()) {
    uint64_t total = 0;
    for (const Copy& c : copies) total += c.bytes;
    EXPECT_EQ(control.bytes_done.load(), total) << "an OK run counts every byte done";
  }
  return s;
}

::testing::AssertionResult LinkConformance::await_progress(const RunControl& control, uint64_t bytes, Flight& flight) {
  const Clock::time_point limit = Clock::now() + 20s;
  while (control.bytes_done.load() < bytes) {
    if (std::optional<Status> ended = flight.outcome_->wait(0ms)) {
      return ::testing::AssertionFailure() << "the run ended (" << ended->to_string() << ") after "
                                           << control.bytes_done.load() << " bytes, before " << bytes;
    }
    if (Clock::now() >= limit) {
      return ::testing::AssertionFailure()
             << "the run moved " << control.bytes_done.load() << " bytes in 20 s, not " << bytes;
    }
    std::this_thread::sleep_for(1ms);
  }
  return ::testing::AssertionSuccess();
}

LinkConformance::Interrupted LinkConformance::interrupt_long_run(TransferOp op,
                                                                 const std::function<void(RunControl&)>& interrupt) {
  const std::vector<Copy> copies = long_copies();
  RunControl control;
  control.deadline = Clock::now() + 60s;
  std::unique_ptr<Flight> flight = launch(op, copies, control);
  EXPECT_TRUE(await_progress(control, uint64_t{8} << 20, *flight));
  interrupt(control);
  const Clock::time_point interrupted = Clock::now();
  Interrupted out;
  out.status = flight->wait();
  out.took = flight->ended() - interrupted;
  out.bytes_done = control.bytes_done.load();
  for (const Copy& c : copies) out.bytes_total += c.bytes;
  return out;
}

std::vector<Copy> LinkConformance::long_copies() {
  constexpr uint64_t kSlotBytes = uint64_t{6} << 20, kSlots = 12, kPerSlot = 300;
  static_assert(kSlots * kSlotBytes <= kBytes);
  std::vector<Copy> copies;
  for (uint64_t i = 0; i < kSlots * kPerSlot; ++i) {
    const uint64_t at = (i / kPerSlot) * kSlotBytes;
    copies.push_back(copy(at, at, kSlotBytes));
  }
  return copies;
}

::testing::AssertionResult LinkConformance::nothing_lands_after(uint64_t bytes, uint8_t value) {
  std::fill(local_.begin(), local_.begin() + static_cast<ptrdiff_t>(bytes), value);
  std::this_thread::sleep_for(100ms);
  const OtherBytes changed = other_bytes(std::span<const uint8_t>(local_.first(bytes)), value);
  if (changed.count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "local byte " << changed.first
                                       << " changed within 100 ms after the run ended: a byte landed late";
}

}  // namespace kvbridge::conformance

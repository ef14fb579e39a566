// tests/conformance/link/link_harness.h: the Link conformance suite's
// fixture, its peer process and the two ways a run is driven.
//
// The suite (link_conformance_test.cc) checks the Link contract of
// transport.h against every transport that crosses processes. The peer
// holding memory is a real child process, link_peer (its path compiled in
// as KVB_LINK_PEER), started through ChildProcess so it dies with the test;
// the test process makes its own transport of the same kind and connects to
// it with the PeerInfo the child printed. Each case runs once per LinkParam:
// a transport and a path, run() on the calling thread or start() with a
// completion (only for links whose runs_async() is true).
//
// A transport that cannot run here (cma without ptrace permission, a build
// or machine without UCX) skips with the factory's reason, unless
// KVB_REQUIRE names it (testing/require.h): then it fails.
//
// Every wait has a deadline and fails saying what it waited for.
// Thread-safety: a fixture's helpers may be called from several test
// threads at once (run() and launch() on one link); LinkPeer from one.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/child_process.h"
#include "conformance/link/link_transport.h"
#include "conformance/peer_buffer.h"
#include "transport/transport.h"

namespace kvbridge::conformance {

// How the suite drives a run: Link::run() on the calling thread, or
// Link::start() with a `done` callback.
enum class RunPath { kRun, kStart };

struct LinkParam {
  std::string name;       // the instantiation's suffix, [A-Za-z0-9_]
  std::string transport;  // "cma", "tcp", "ucx"
  RunPath path = RunPath::kRun;
};

inline void PrintTo(const LinkParam& p, std::ostream* os) {
  *os << p.name << " (transport " << p.transport << ", " << (p.path == RunPath::kRun ? "run()" : "start()") << ")";
}

std::string link_param_name(const ::testing::TestParamInfo<LinkParam>& info);

// link_peer in a child process (its protocol is at the top of link_peer.cc).
class LinkPeer {
 public:
  // Starts link_peer with `transport`, a buffer of `bytes` bytes of pattern
  // `seed`; kUnavailable with the child's reason when its transport cannot
  // start, kIoError when it does not answer.
  static Result<std::unique_ptr<LinkPeer>> start(const std::string& transport, uint64_t bytes, uint32_t seed);
  ~LinkPeer();  // "exit", then ChildProcess stops it

  // What this process passes to Transport::connect, under peer name `name`.
  transport::PeerInfo info(const std::string& name) const;
  uint64_t base() const { return base_; }
  pid_t pid() const { return pid_; }

  // Whether the peer's bytes [offset, offset + len) equal pattern `seed`
  // bytes [from, from + len).
  ::testing::AssertionResult check(uint64_t offset, uint64_t len, uint32_t seed, uint64_t from);
  // Sets the peer's bytes [offset, offset + len) to pattern `seed` bytes
  // [offset, offset + len) (seed 0: zeros).
  Status fill(uint64_t offset, uint64_t len, uint32_t seed);
  // How many of the peer's bytes [offset, offset + len) equal `value`.
  Result<uint64_t> count(uint64_t offset, uint64_t len, uint8_t value);
  // SIGKILL, and reaps it; later commands fail with kUnavailable.
  void kill();

 private:
  LinkPeer() = default;
  Result<std::string> command(const std::string& line);
  std::unique_ptr<ChildProcess> child_;
  std::string address_, key_, memory_;
  uint64_t base_ = 0, bytes_ = 0;
  pid_t pid_ = -1;
  bool killed_ = false;
};

// The outcome of one run, set once by whoever ends it (the run()'s thread
// or the transport's `done`), counting how often that happened.
class Outcome {
 public:
  void set(Status s);
  // The status, waiting up to `limit`; nullopt when it did not come.
  std::optional<Status> wait(std::chrono::milliseconds limit);
  int calls();
  transport::Clock::time_point ended();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Status> status_;
  int calls_ = 0;
  transport::Clock::time_point ended_{};
};

class LinkConformance : public ::testing::TestWithParam<LinkParam> {
 protected:
  static constexpr uint64_t kBytes = uint64_t{72} << 20;  // each side's buffer
  static constexpr uint32_t kPeerSeed = 7;                // the peer's pattern
  static constexpr uint32_t kLocalSeed = 11;              // what local memory holds before a write
  static constexpr auto kWaitLimit = std::chrono::seconds(60);

  void SetUp() override;
  void TearDown() override;

  // A run in flight; wait() ends it. Requires: the copies and the control
  // it was given stay alive until wait() returned.
  class Flight {
   public:
    ~Flight();
    // The run's status; one that does not end within kWaitLimit fails the
    // test and aborts (its copies and control would dangle).
    Status wait();
    // When the run ended (valid after wait()).
    transport::Clock::time_point ended() const { return outcome_->ended(); }

   private:
    friend class LinkConformance;
    std::shared_ptr<Outcome> outcome_;
    std::thread thread_;  // the run() path's thread
  };

  // Starts a run by the param's path: run() on a thread of its own, or start().
  std::unique_ptr<Flight> launch(TransferOp op, std::span<const transport::Copy> copies,
                                 transport::RunControl& control);
  // Runs to the end by the param's path, with a deadline `timeout` from now;
  // on OK, expects bytes_done to be every byte of `copies`.
  Status run(TransferOp op, const std::vector<transport::Copy>& copies,
             std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Waits until `control` counts at least `bytes` done; fails when the run
  // ends first or 20 s pass.
  ::testing::AssertionResult await_progress(const transport::RunControl& control, uint64_t bytes, Flight& flight);

  // What became of a long run interrupted mid-way.
  struct Interrupted {
    Status status;
    uint64_t bytes_done = 0, bytes_total = 0;
    transport::Clock::duration took{};  // from the interruption to the run's end
  };
  // Starts a run of long_copies() by the param's path (deadline in 60 s),
  // waits until 8 MiB of it are done (a failure of the test if it does not
  // get there), calls `interrupt` (cancel it, kill the peer), and waits for
  // the run's end.
  Interrupted interrupt_long_run(TransferOp op, const std::function<void(transport::RunControl&)>& interrupt);

  // A copy between local_[local_offset] and the peer's buffer at remote_offset.
  transport::Copy copy(uint64_t local_offset, uint64_t remote_offset, uint64_t bytes) {
    return transport::Copy{local_.data() + local_offset, peer_->base() + remote_offset, bytes, kLinkSegment};
  }
  // ~21 GiB of copies in twelve slots of 6 MiB (local slot s to and from
  // remote slot s), slot after slot: a run that cannot finish in seconds.
  // Transports with threads of their own split a run by bytes into at most
  // four contiguous shares (cma's threads, tcp's streams here), whose
  // boundaries then fall between slots: no two threads write the same bytes
  // on either side, which keeps ThreadSanitizer runs clean.
  std::vector<transport::Copy> long_copies();
  // Sets local_ [0, bytes) to `value`, waits 100 ms, and checks that it
  // still holds only `value`: no byte of a run that ended landed since.
  ::testing::AssertionResult nothing_lands_after(uint64_t bytes, uint8_t value = 0xab);
  std::string peer_name() const { return "peer-" + GetParam().transport; }

  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<LinkPeer> peer_;
  PeerBuffer local_memory_;   // host memory, zero at start (an anonymous mapping); outlives link_
  std::span<uint8_t> local_;  // local_memory_, kBytes
  std::unique_ptr<transport::Link> link_;
  std::mutex outcomes_mu_;
  std::vector<std::shared_ptr<Outcome>> outcomes_;  // every start()'s, checked at TearDown
};

}  // namespace kvbridge::conformance

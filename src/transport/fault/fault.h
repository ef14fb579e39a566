// transport/fault.h: a fault-injecting wrapper around any Transport.
//
// The wrapper has the inner transport's name and address, so a peer sees
// nothing different; its Links pass runs to the inner Link unless a fault
// is armed. Faults are armed on a shared Faults object, which tests keep:
//  - fail_run(n, error): the nth run from now returns `error`, moving nothing;
//  - truncate_run(n, bytes, error): the nth run moves its first `bytes`
//    bytes, counts them in bytes_done, then returns `error`;
//  - set_delay(d, piece): a slow link: every run passes its copies to the
//    inner Link one piece (at most `piece` bytes, a page by default) at a
//    time and sleeps `d` before each. Pieces, not copies: the engine merges
//    items adjacent on both sides into one copy, so a test's 100 adjacent
//    4 KiB items are one copy by the time a Link sees them;
//  - set_cancel_linger(d): a link slow to notice cancel and deadlines: once
//    it sees one it keeps copying for up to `d` before returning (still
//    honouring the Link contract: nothing lands after run() returns);
//  - drop_notifications(n, prefix): the engine drops the next n
//    notifications whose message starts with `prefix` (empty: any; the
//    engine asks take_notification_drop() through its test hook, because
//    notifications travel on the control connection, not through a Link);
//  - set_notification_chaos(drop, duplicate, seed): from now on each
//    notification is lost with probability drop/1000 and sent twice with
//    probability duplicate/1000, drawn from a generator seeded with `seed`
//    (one sequence per Faults object: a run replays from its seed when the
//    messages come in the same order).
//  - set_skip_copies(true): every run reports its copies' bytes done
//    without copying them: for measuring the host's cost of a load without
//    its copies (bench/connector_bench.cc). A load so run reports bytes it
//    never moved; nothing that checks bytes may arm it.
// It also counts runs, so a test can check that none is executing.
//
// Thread-safety: Faults is safe from any thread; the wrapper is as the inner
// transport. Ownership: the wrapper owns the inner transport and shares the
// Faults object with the test.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "transport/transport.h"

namespace kvbridge::transport {

class Faults {
 public:
  void fail_run(uint64_t nth, Status error);
  void truncate_run(uint64_t nth, uint64_t bytes, Status error);
  static constexpr uint64_t kDefaultDelayPiece = 4096;
  void set_delay(std::chrono::milliseconds per_piece, uint64_t piece_bytes = kDefaultDelayPiece);
  void set_cancel_linger(std::chrono::milliseconds linger);
  void drop_notifications(uint64_t count, std::string prefix = {});
  void set_notification_chaos(uint32_t drop_per_mille, uint32_t duplicate_per_mille, uint64_t seed);
  void set_skip_copies(bool skip);
  // Disarms everything (counters stay).
  void clear();

  // True once per armed drop, for a message with the armed prefix; or as
  // the chaos draws.
  bool take_notification_drop(std::string_view message);
  // True when the chaos draws that this message goes twice.
  bool take_notification_duplicate(std::string_view message);

  // Whether a delay or a cancel linger is armed: runs are then slow, and
  // the engine must not run them on a submitting thread.
  bool slows_runs() const;
  // Whether any fault of a run (fail, truncate, delay, linger, skip) is armed.
  bool arms_runs() const;
  uint64_t runs_started() const;
  uint64_t runs_active() const;  // runs that started and have not returned

  // What one run should do; used by the wrapper's Link.
  struct Plan {
    std::optional<Status> fail;
    std::optional<uint64_t> truncate_bytes;
    Status truncate_error;
    std::chrono::milliseconds delay{0};
    uint64_t delay_piece = kDefaultDelayPiece;
    std::chrono::milliseconds linger{0};
    bool skip_copies = false;
    // Whether the run has any fault to play.
    bool any() const { return fail || truncate_bytes || delay.count() > 0 || linger.count() > 0 || skip_copies; }
  };
  Plan begin_run();
  void end_run();

 private:
  mutable std::mutex mu_;
  uint64_t started_ = 0, active_ = 0;
  std::optional<std::pair<uint64_t, Status>> fail_;  // absolute run number
  std::optional<uint64_t> truncate_at_;
  uint64_t truncate_bytes_ = 0;
  Status truncate_error_;
  std::chrono::milliseconds delay_{0}, linger_{0};
  bool skip_copies_ = false;
  uint64_t delay_piece_ = kDefaultDelayPiece;
  uint64_t drops_ = 0;
  std::string drop_prefix_;
  uint32_t chaos_drop_ = 0, chaos_duplicate_ = 0;  // per mille
  uint64_t chaos_state_ = 0;                       // splitmix64
  uint32_t draw();                                 // requires mu_: 0..999
};

// Wraps `inner`. Requires both non-null.
std::unique_ptr<Transport> make_fault_transport(std::unique_ptr<Transport> inner, std::shared_ptr<Faults> faults);

}  // namespace kvbridge::transport

// engine/transfers.h: the transfer table and the threads that execute it.
//
// A Transfer is a checked, resolved batch: its copies are already split into
// chunks (one Link::run each) and its local regions are held in use. The
// table runs chunks on a pool of worker threads, enforces deadlines with a
// timer thread, sends the notification after every run returned OK, and ends
// each transfer exactly once.
//
// Three ways a chunk runs: on a worker thread (or a wait() that helps), on
// the submitting thread (small same-host transfers, Link::runs_inline), or
// handed to a link with its own thread (Link::runs_async), whose completion
// callback does the bookkeeping a worker would. A notification due after the
// last run is handed to the control channel, which calls back when the
// peer's acknowledgement arrives (or the deadline passes, or the peer goes):
// no thread waits for it.
//
// The one rule everything follows: a transfer ends (its state leaves
// kInProgress, its regions are released) only when no Link::run of it is
// executing and none can start. Workers test `stop` and bump `running` under
// the transfer's lock before each run; cancel, deadlines, peer loss and the
// first error set `stop` and each RunControl's cancel flag under that lock.
// So when cancel() returns, or any observer sees the transfer ended, every
// run has returned, and Links promise nothing lands after they return.
//
// Thread-safety: every method may be called from any thread. A transfer's
// lock nests with no other: it releases its regions' holds (atomics) under
// it, never taking the registry lock, so completion callbacks may run on a
// transport's thread; the table lock is never held together with a
// transfer's lock (docs/thread_model.md).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/control.h"
#include "engine/metrics.h"
#include "engine/registry.h"
#include "kvbridge/engine.h"
#include "transport/transport.h"

namespace kvbridge::engine_internal {

// A transfer's copies held as runs (Engine::submit with runs): the literal
// copies, and runs over them, each those copies as they are, moved by
// fixed deltas (the pointer arithmetic is modulo 2^64) into one segment,
// or moved by each move of a table in turn (a prepared table of moves:
// one run however many layers it repeats, so that a submit writes no
// per-layer state).
struct CopyMove {
  uint64_t local_delta = 0, remote_delta = 0;  // added to each copy's local pointer and remote address
  uint32_t segment = 0;                        // every copy's
};
struct CopyRun {
  uint64_t first = 0, count = 0;  // copies [first, first + count)
  bool moved = false;
  uint64_t local_delta = 0, remote_delta = 0;  // moved: added to each copy's local pointer and remote address
  uint32_t segment = 0;                        // moved: every copy's
  // A table run (`moved` false): the copies moved by moves[0], then by
  // moves[1], ... moves[move_count - 1]; the program holds the table.
  const CopyMove* moves = nullptr;
  uint64_t move_count = 0;
  // The run of move k of a table run: a moved run.
  CopyRun move(uint64_t k) const {
    return {first, count, true, moves[k].local_delta, moves[k].remote_delta, moves[k].segment};
  }
};
// The literal copies a program's runs name: a batch's own, or a prepared
// list's, shared by every program submitted from it.
struct CopyList {
  std::vector<transport::Copy> copies;
  std::vector<uint64_t> ends;  // ends[i]: the bytes of copies [0, i); copies.size() + 1 of them
  void count_ends() {
    ends.resize(copies.size() + 1);
    ends[0] = 0;
    for (size_t i = 0; i < copies.size(); ++i) ends[i + 1] = ends[i] + copies[i].bytes;
  }
};
struct CopyProgram {
  std::shared_ptr<const CopyList> literal;
  std::vector<CopyRun> runs;
  std::vector<std::shared_ptr<const std::vector<CopyMove>>> tables;  // what table runs point into
  const std::vector<transport::Copy>& copies() const { return literal->copies; }
  const std::vector<uint64_t>& ends() const { return literal->ends; }
  uint64_t bytes(const CopyRun& r) const {
    return (ends()[r.first + r.count] - ends()[r.first]) * (r.moves != nullptr ? r.move_count : 1);
  }
};

// The number of copies `runs` hold.
uint64_t copies_of(std::span<const CopyRun> runs);
// Writes the copies `runs` of `program` hold, in order, at `out` (room for
// copies_of(runs) of them); returns how many.
uint64_t expand_runs(const CopyProgram& program, std::span<const CopyRun> runs, transport::Copy* out);
// Appends them to `out`.
void expand_runs(const CopyProgram& program, std::span<const CopyRun> runs, std::vector<transport::Copy>* out);
// Cuts the runs of `program` into at most `parts` shares of about equal
// bytes, at copy boundaries; small programs stay one share.
std::vector<std::vector<CopyRun>> split_runs(const CopyProgram& program, size_t parts);

struct Chunk {
  std::vector<transport::Copy> copies;
  // A chunk of a program: `copies` is empty until the chunk runs, when
  // its runs are expanded into it (expand()).
  std::shared_ptr<const CopyProgram> program;
  std::vector<CopyRun> runs;
  transport::RunControl control;
  void expand() {
    if (program == nullptr) return;
    expand_runs(*program, runs, &copies);
    program.reset();
    runs = {};
  }
};

// A transfer's chunks: sized once, never moved (RunControl cannot move).
// One allocation, where a deque took two.
class ChunkArray {
 public:
  void reset(size_t n) {
    data_ = std::make_unique<Chunk[]>(n);
    size_ = n;
  }
  size_t size() const { return size_; }
  Chunk& operator[](size_t i) { return data_[i]; }
  const Chunk& operator[](size_t i) const { return data_[i]; }
  Chunk* begin() { return data_.get(); }
  Chunk* end() { return data_.get() + size_; }
  const Chunk* begin() const { return data_.get(); }
  const Chunk* end() const { return data_.get() + size_; }

 private:
  std::unique_ptr<Chunk[]> data_;
  size_t size_ = 0;
};

struct Transfer;
// Deadlines of transfers in progress, earliest first.
using DeadlineQueue = std::multimap<Clock::time_point, std::weak_ptr<Transfer>>;

struct Transfer {
  // Set before start(), then read-only.
  TransferId id = 0;
  uint64_t connection = 0;                       // the peer connection (link + channel) it runs on
  std::shared_ptr<const std::string> peer_name;  // peer_text() of the peer (the Peer's, shared)
  TransferOp op = TransferOp::kRead;
  std::shared_ptr<transport::Link> link;
  std::shared_ptr<Channel> channel;
  std::string notification;
  std::vector<RegionHold> holds;                         // its local regions' holds, released once when it ends
  std::vector<std::shared_ptr<const HeldRegions>> held;  // holds shared with prepared tables: let go when it ends
  uint64_t bytes_total = 0;
  // Called once when the transfer ends, with no lock held (SubmitOptions::on_end).
  std::function<void(TransferId, const TransferStatus&)> on_end;
  std::atomic<bool> end_reported{false};
  Clock::time_point start;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  ChunkArray chunks;
  bool run_here = false;        // runs on the submitting thread: never queued, no deadline entry
  bool verify_content = false;  // SubmitOptions::verify_content: each run's copies are hashed on both sides
  bool device = false;          // some copy touches device memory (here or on the peer)

  // Guarded by mu.
  mutable std::mutex mu;
  std::condition_variable cv;
  size_t chunks_left = 0;  // chunks not yet finished or skipped
  size_t running = 0;      // Link::run calls executing now
  bool stop = false;       // no further run starts
  bool cancelled = false;  // stopped by cancel(): ends as kCancelled
  bool notifying = false;  // every run returned OK; the notification is on its way
  Status stop_reason;      // the first cause
  bool ended = false;
  Clock::time_point ended_at;
  TransferState state = TransferState::kInProgress;
  Status error;

  // Guarded by the table lock (Transfers::mu_), not by mu.
  size_t queued = 0;                       // its chunks still in the work queue
  bool has_deadline = false;               // deadline_entry is in the deadline queue
  DeadlineQueue::iterator deadline_entry;  // erased when the transfer ends or is released
};

// A counting semaphore on a Linux futex, for waking workers. Unlike
// pthread_cond_signal, release() never blocks (glibc's can wait for an earlier
// group of waiters to drain); unlike std::counting_semaphore, acquire() never
// spins, so a worker that just went idle does not snatch the chunk a wait()
// is about to run on its own thread.
class WakeTokens {
 public:
  // Adds n tokens and, with `wake`, wakes up to n sleepers; true when it
  // woke anyone (made the call that wakes them).
  bool release(uint32_t n, bool wake = true);
  // Wakes up to n sleepers for tokens already added; true as release().
  bool wake(uint32_t n);
  void acquire();

 private:
  std::atomic<uint32_t> tokens_{0};
  std::atomic<uint32_t> sleepers_{0};
};

// Splits `copies` into at most `parts` chunks of about equal bytes, cutting a
// copy where needed, as `chunks` (reset to them); small batches stay one
// chunk, their list moved there whole.
void split_copies(std::vector<transport::Copy> copies, size_t parts, ChunkArray* chunks);

// The content check of one run that returned OK: the content hash
// (transport::content_hash) of each copy's local side (`device`: device
// memory among them is hashed by the device's kernel) against the link's
// digest of its remote side (Link::digest). kIoError naming the first copy
// that differs (its bytes, the peer's address and segment, both hashes;
// `*differ` set), or the digest's or the device's error.
Status check_content(transport::Link& link, TransferOp op, std::span<const transport::Copy> copies, bool device,
                     transport::RunControl& control, bool* differ);

class Transfers {
 public:
  struct Callbacks {
    // Fault injection: whether to drop the next notification.
    std::function<bool(std::string_view message)> drop_notification;
  };

  Transfers(size_t threads, Metrics* metrics, Callbacks callbacks);
  // Requires shutdown() to have been called.
  ~Transfers();

  // Assigns the id, records and queues the transfer; returns the id.
  // kUnavailable after shutdown() (the caller still owns the regions).
  // With `here`, the transfer (which must have no notification) is not
  // queued: its chunks run on the calling thread, with the bookkeeping a
  // worker keeps, so it has ended when start() returns. Otherwise, when its
  // link runs_async(), its chunks are handed to the link at once.
  Result<TransferId> start(std::shared_ptr<Transfer> t, bool here = false);

  // Between hold_wakes() and release_held() on one thread (they nest), the
  // chunks that thread's start() queues are queued at once, and workers
  // are woken for the first, then once per few (kBatchWakeTokens) and at
  // release_held() for the rest, not once per transfer
  // (Engine::begin_batch()). A worker already awake takes them meanwhile.
  void hold_wakes();
  void release_held();

  TransferStatus status(TransferId id) const;
  // Waits for the transfer to end. When the wait may last past the
  // transfer's deadline anyway, the calling thread first runs the
  // transfer's chunks still queued (as a worker would), instead of sleeping
  // while a worker wakes up to run them.
  TransferStatus wait(TransferId id, std::chrono::milliseconds timeout);
  Status cancel(TransferId id);
  Status release(TransferId id);

  // Ends every transfer on peer connection `connection` still in progress
  // as kFailed with `why` (once its runs return).
  void fail_peer(uint64_t connection, const Status& why);
  // Waits until every transfer on `connection` submitted so far has ended.
  Status wait_peer(uint64_t connection, Clock::time_point deadline);

  // Cancels everything in progress (kCancelled, "engine is shutting down"),
  // waits for runs to return, joins the threads.
  void shutdown();

 private:
  // A queued chunk.
  struct Job {
    std::shared_ptr<Transfer> t;
    size_t chunk = 0;
  };
  std::shared_ptr<Transfer> find(TransferId id) const;
  static TransferStatus status_of(const Transfer& t);
  // Takes one of t's chunks off the work queue (the last queued), if any.
  std::optional<size_t> take_queued(Transfer& t);
  // Requires no lock held. Removes t's deadline entry once t ended.
  void forget_deadline(Transfer& t);
  // Requires no lock held and t ended: forgets its deadline and calls its
  // on_end, once whoever gets here first.
  void after_end(const std::shared_ptr<Transfer>& t);
  void worker();
  void timer();
  // Runs one chunk with the table's bookkeeping. A queued chunk whose
  // transfer passed its deadline while it waited is skipped.
  void run_chunk(const std::shared_ptr<Transfer>& t, size_t chunk);
  // One Link::run of `copies` (a chunk's, or a piece of its program) and,
  // when the transfer asks, the content check of what it moved.
  Status run_copies(Transfer& t, std::span<const transport::Copy> copies, transport::RunControl& control);
  // Hands one chunk to the link (Link::start).
  void start_chunk(const std::shared_ptr<Transfer>& t, size_t chunk);
  // Bookkeeping before a run: false when the chunk is skipped (the transfer
  // stopped, or, with `check_deadline`, passed its deadline while queued).
  bool begin_chunk(const std::shared_ptr<Transfer>& t, size_t chunk, bool check_deadline);
  // Bookkeeping after a run returned `s`; hands a notification due to the
  // channel.
  void end_chunk(const std::shared_ptr<Transfer>& t, Status s);
  void start_notification(const std::shared_ptr<Transfer>& t);
  void end_notification(const std::shared_ptr<Transfer>& t, Status s);
  // Requires t.mu held. Stops the transfer with `why` unless already stopped.
  static void stop_locked(Transfer& t, Status why, bool cancelled);
  // Requires t.mu held, t.running == 0. Ends the transfer once.
  void finish_locked(Transfer& t);

  Metrics* const metrics_;
  const Callbacks callbacks_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable timer_cv_;
  // One token per chunk queued (and one per worker at shutdown). A worker
  // takes a token, then a job if one is left (wait() may have taken it), so
  // there are never fewer tokens than queued jobs. A semaphore rather than a
  // condition variable: see WakeTokens.
  WakeTokens work_sem_;
  bool stopping_ = false;
  TransferId next_id_ = 1;
  std::map<TransferId, std::shared_ptr<Transfer>> table_;
  std::deque<Job> queue_;
  DeadlineQueue deadlines_;  // an entry per transfer not yet ended (or released)
  // When the timer wakes next (max: only when notified). start() wakes it
  // only for a deadline earlier than that.
  Clock::time_point timer_wake_ = Clock::time_point::max();
  std::vector<std::thread> workers_;
  std::thread timer_;

  // Completion callbacks of asynchronous runs and notifications not yet
  // returned; shutdown() waits for them, since they use this object (the
  // engine closes its channels first, which ends every notification).
  std::mutex async_mu_;
  std::condition_variable async_cv_;
  size_t async_callbacks_ = 0;
};

}  // namespace kvbridge::engine_internal

// Transfer execution: workers, deadlines, cancel, notification, completion.
#include "engine/transfers.h"

#include "transport/copies.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "common/thread_name.h"

namespace kvbridge::engine_internal {
namespace {

// Copies a program's share expands at a time on a link that copies host
// memory in this process (Transfers::run_chunk).
constexpr uint64_t kPieceCopies = 1024;

// The batches open on this thread (Transfers::hold_wakes()): per engine's
// transfer table, how deep, and the tokens queued without a wake-up.
struct Held {
  const Transfers* owner = nullptr;
  uint32_t depth = 0;
  uint32_t tokens = 0;  // queued since the last wake-up
  bool woke = false;    // for the batch's first chunks
};
// A batch wakes the engine's threads again once this many chunks are
// queued without a wake-up.
constexpr uint32_t kBatchWakeTokens = 16;
thread_local std::vector<Held> held_wakes;

Held* held_for(const Transfers* t) {
  for (Held& h : held_wakes) {
    if (h.owner == t) return &h;
  }
  return nullptr;
}

std::string transfer_name(const Transfer& t) {
  return "transfer " + std::to_string(t.id) + " with peer " + *t.peer_name;
}

}  // namespace

Transfers::Transfers(size_t threads, Metrics* metrics, Callbacks callbacks)
    : metrics_(metrics), callbacks_(std::move(callbacks)) {
  for (size_t i = 0; i < std::max<size_t>(threads, 1); ++i) workers_.emplace_back([this] { worker(); });
  timer_ = std::thread([this] { timer(); });
}

Transfers::~Transfers() { shutdown(); }

std::shared_ptr<Transfer> Transfers::find(TransferId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = table_.find(id);
  return it == table_.end() ? nullptr : it->second;
}

Result<TransferId> Transfers::start(std::shared_ptr<Transfer> t, bool here) {
  TransferId id = 0;
  const size_t chunks = t->chunks.size();
  // A content check hashes on the engine thread after the run: such a
  // transfer's chunks run there, not on the link's own thread. A
  // program's chunks are expanded as they are handed to the link (here):
  // run synchronously on the engine's workers instead, a read from a peer
  // that stopped would hold them until its deadline, and every other
  // transfer behind it.
  const bool async = !here && t->link->runs_async() && !t->verify_content;
  bool earliest = false;
  std::shared_ptr<Transfer> keep = t;
  t->run_here = here;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Status::unavailable("engine is shutting down");
    id = t->id = next_id_++;
    t->chunks_left = chunks;
    // A transfer run here has no deadline entry: its runs watch the deadline
    // themselves, and it ends before anyone else can hold its id. It is in
    // the table while it runs, so shutdown() and fail_peer() still see it.
    if (!here) {
      // Entries leave the queue when transfers end, so it is often empty;
      // the timer needs waking only when it would sleep past this deadline.
      earliest = t->deadline < timer_wake_;
      if (earliest) timer_wake_ = t->deadline;
      t->deadline_entry = deadlines_.emplace(t->deadline, t);
      t->has_deadline = true;
    }
    if (!here && !async) {
      t->queued = chunks;
      for (size_t i = 0; i < chunks; ++i) queue_.push_back(Job{t, i});
    }
    table_.emplace(id, std::move(t));
  }
  if (earliest) timer_cv_.notify_one();
  if (here) {
    for (size_t i = 0; i < chunks; ++i) run_chunk(keep, i);
  } else if (async) {
    for (size_t i = 0; i < chunks; ++i) start_chunk(keep, i);
  } else if (Held* held = held_for(this)) {
    // In a batch: the tokens now; a wake-up for the batch's first chunks
    // (the copies start at once), then one per kBatchWakeTokens chunks
    // (threads that went back to sleep meanwhile wait that long at most),
    // and one at its end for the rest.
    work_sem_.release(static_cast<uint32_t>(chunks), /*wake=*/false);
    held->tokens += static_cast<uint32_t>(chunks);
    if (!held->woke || held->tokens >= kBatchWakeTokens) {
      held->woke = true;
      if (work_sem_.wake(std::exchange(held->tokens, 0))) metrics_->worker_woken();
    }
  } else if (work_sem_.release(static_cast<uint32_t>(chunks))) {
    // One token per queued chunk: wakes at most that many workers.
    metrics_->worker_woken();
  }
  return id;
}

void Transfers::hold_wakes() {
  if (Held* held = held_for(this)) {
    ++held->depth;
  } else {
    held_wakes.push_back({this, 1, 0, false});
  }
}

void Transfers::release_held() {
  Held* held = held_for(this);
  if (held == nullptr || --held->depth > 0) return;
  const uint32_t tokens = held->tokens;
  held_wakes.erase(held_wakes.begin() + (held - held_wakes.data()));
  if (work_sem_.wake(tokens)) metrics_->worker_woken();
}

std::optional<size_t> Transfers::take_queued(Transfer& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (t.queued == 0) return std::nullopt;
  // The last one queued: workers take from the front, so a split transfer
  // still runs on them and this thread at once.
  for (auto it = queue_.rbegin(); it != queue_.rend(); ++it) {
    if (it->t.get() != &t) continue;
    const size_t chunk = it->chunk;
    queue_.erase(std::next(it).base());
    --t.queued;
    return chunk;
  }
  return std::nullopt;  // not reached: queued counts t's jobs in queue_
}

void Transfers::forget_deadline(Transfer& t) {
  if (t.run_here) return;  // never had an entry
  std::lock_guard<std::mutex> lock(mu_);
  if (!t.has_deadline) return;
  deadlines_.erase(t.deadline_entry);
  t.has_deadline = false;
}

void Transfers::after_end(const std::shared_ptr<Transfer>& t) {
  forget_deadline(*t);
  if (!t->on_end || t->end_reported.exchange(true)) return;
  t->on_end(t->id, status_of(*t));
}

void Transfers::stop_locked(Transfer& t, Status why, bool cancelled) {
  if (t.stop) return;
  t.stop = true;
  t.cancelled = cancelled;
  t.stop_reason = std::move(why);
  for (Chunk& c : t.chunks) c.control.cancel.store(true, std::memory_order_release);
}

void Transfers::finish_locked(Transfer& t) {
  if (t.ended) return;
  if (t.stop) {
    t.state = t.cancelled ? TransferState::kCancelled : TransferState::kFailed;
    t.error = t.stop_reason;
  } else {
    t.state = TransferState::kDone;
  }
  // Regions first: whoever sees the end may deregister at once.
  for (const RegionHold& hold : t.holds) Registry::release(hold);
  t.holds.clear();
  t.held.clear();
  uint64_t done = 0;
  for (const Chunk& c : t.chunks) done += c.control.bytes_done.load(std::memory_order_acquire);
  if (t.state == TransferState::kDone) done = t.bytes_total;
  t.ended_at = Clock::now();
  metrics_->ended(t.state, t.op, done, t.ended_at - t.start);
  t.ended = true;
  t.cv.notify_all();
}

void Transfers::worker() {
  set_thread_name("kvb-worker");
  while (true) {
    work_sem_.acquire();
    Job job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty()) {
        if (stopping_) return;  // nothing left to skip
        continue;               // a wait() ran the chunk of this token itself
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      --job.t->queued;
    }
    run_chunk(job.t, job.chunk);
  }
}

bool Transfers::begin_chunk(const std::shared_ptr<Transfer>& tp, size_t index, bool check_deadline) {
  Transfer& t = *tp;
  bool ended = false;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (check_deadline && !t.stop && Clock::now() >= t.deadline) {
      stop_locked(t,
                  Status::timeout(transfer_name(t) + " passed its deadline of " + std::to_string(t.timeout.count()) +
                                  " ms before it started"),
                  false);
    }
    if (!t.stop && !t.ended) {
      ++t.running;
      t.chunks[index].control.deadline = t.deadline;
      return true;
    }
    --t.chunks_left;
    if (t.running == 0) finish_locked(t);
    ended = t.ended;
  }
  if (ended) after_end(tp);
  return false;
}

void Transfers::run_chunk(const std::shared_ptr<Transfer>& tp, size_t index) {
  Transfer& t = *tp;
  // A chunk run where it was submitted has not waited in a queue: its
  // deadline is its timeout away, and the Link watches it from here.
  if (!begin_chunk(tp, index, !t.run_here)) return;
  Chunk& chunk = t.chunks[index];
  // A program's share on a link that copies host memory in this process
  // (local, cma) runs in pieces expanded into one small buffer, which
  // stays in cache: none of its copies' list is ever whole in memory.
  // Other links take the whole list at once (a network run per piece
  // would wait for the peer each time; a device run is one batch).
  if (chunk.program != nullptr && !t.device && t.link->runs_inline()) {
    std::vector<transport::Copy> piece(kPieceCopies);
    Status s;
    auto pieces = [&](const CopyRun& run) {
      for (uint64_t at = 0; at < run.count && s.ok(); at += kPieceCopies) {
        CopyRun part = run;
        part.first = run.first + at;
        part.count = std::min<uint64_t>(kPieceCopies, run.count - at);
        const uint64_t n = expand_runs(*chunk.program, {&part, 1}, piece.data());
        s = run_copies(t, {piece.data(), n}, chunk.control);
      }
    };
    for (const CopyRun& run : chunk.runs) {
      if (run.moves == nullptr) pieces(run);
      for (uint64_t k = 0; run.moves != nullptr && k < run.move_count && s.ok(); ++k) pieces(run.move(k));
      if (!s.ok()) break;
    }
    end_chunk(tp, std::move(s));
    return;
  }
  chunk.expand();
  end_chunk(tp, run_copies(t, chunk.copies, chunk.control));
}

Status Transfers::run_copies(Transfer& t, std::span<const transport::Copy> copies, transport::RunControl& control) {
  Status s = t.link->run(t.op, copies, control);
  if (s.ok() && t.verify_content) {
    bool differ = false;
    s = check_content(*t.link, t.op, copies, t.device, control, &differ);
    if (s.ok()) {
      uint64_t bytes = 0;
      for (const transport::Copy& c : copies) bytes += c.bytes;
      metrics_->content_checked(bytes);
    } else if (differ) {
      metrics_->content_check_failed();
    }
  }
  return s;
}

void Transfers::start_chunk(const std::shared_ptr<Transfer>& tp, size_t index) {
  if (!begin_chunk(tp, index, false)) return;
  {
    std::lock_guard<std::mutex> lock(async_mu_);
    ++async_callbacks_;
  }
  Chunk& chunk = tp->chunks[index];
  chunk.expand();
  tp->link->start(tp->op, chunk.copies, chunk.control, [this, tp](Status s) {
    end_chunk(tp, std::move(s));
    std::lock_guard<std::mutex> lock(async_mu_);
    if (--async_callbacks_ == 0) async_cv_.notify_all();
  });
}

void Transfers::end_chunk(const std::shared_ptr<Transfer>& tp, Status s) {
  Transfer& t = *tp;
  bool notify = false, ended = false;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    --t.running;
    --t.chunks_left;
    // A run that saw the stop flag reports kCancelled; the cause is already
    // recorded, so only an error from a run that was not told to stop counts.
    if (!s.ok() && !t.stop) stop_locked(t, s.with_context(transfer_name(t)), false);
    if (t.running == 0 && (t.stop || t.chunks_left == 0)) {
      if (!t.stop && !t.notification.empty()) {
        notify = true;
        t.notifying = true;
      } else {
        finish_locked(t);
      }
    }
    ended = t.ended;
    t.cv.notify_all();
  }
  if (ended) after_end(tp);
  if (notify) start_notification(tp);
}

void Transfers::start_notification(const std::shared_ptr<Transfer>& tp) {
  Transfer& t = *tp;
  if (!t.channel) {
    return end_notification(tp, Status::unavailable("no control connection to peer " + *t.peer_name));
  }
  {
    std::lock_guard<std::mutex> lock(async_mu_);
    ++async_callbacks_;
  }
  const bool drop = callbacks_.drop_notification && callbacks_.drop_notification(t.notification);
  // Nothing waits for the acknowledgement: the channel calls back when it
  // comes, at the deadline, or when the peer is gone.
  t.channel->notify(
      t.notification, t.deadline,
      [this, tp](Status s) {
        end_notification(tp, std::move(s));
        std::lock_guard<std::mutex> lock(async_mu_);
        if (--async_callbacks_ == 0) async_cv_.notify_all();
      },
      drop);
}

void Transfers::end_notification(const std::shared_ptr<Transfer>& tp, Status s) {
  Transfer& t = *tp;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.ended) return;  // cancelled, timed out or the peer went meanwhile
    if (s.ok()) {
      metrics_->notification_sent();
    } else {
      stop_locked(t, s.with_context(transfer_name(t) + ": notification"), false);
    }
    finish_locked(t);
  }
  after_end(tp);
}

void Transfers::timer() {
  set_thread_name("kvb-timer");
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (deadlines_.empty()) {
      timer_wake_ = Clock::time_point::max();
      timer_cv_.wait(lock);
      continue;
    }
    auto first = deadlines_.begin();
    if (Clock::now() < first->first) {
      // A copy: wait_until reads its argument while the lock is released,
      // and another thread may erase the node meanwhile.
      const Clock::time_point wake = first->first;
      timer_wake_ = wake;
      timer_cv_.wait_until(lock, wake);
      continue;
    }
    std::shared_ptr<Transfer> t = first->second.lock();
    deadlines_.erase(first);
    if (!t) continue;
    t->has_deadline = false;
    lock.unlock();
    {
      std::lock_guard<std::mutex> tl(t->mu);
      if (!t->ended) {
        stop_locked(
            *t,
            Status::timeout(transfer_name(*t) + " passed its deadline of " + std::to_string(t->timeout.count()) +
                            " ms" + (t->notifying ? " waiting for the peer to acknowledge the notification" : "")),
            false);
        // With runs executing, the last one to return ends the transfer.
        if (t->running == 0) finish_locked(*t);
      }
    }
    bool ended = false;
    {
      std::lock_guard<std::mutex> tl(t->mu);
      ended = t->ended;
    }
    if (ended) after_end(t);
    lock.lock();
  }
}

TransferStatus Transfers::status_of(const Transfer& t) {
  TransferStatus out;
  std::lock_guard<std::mutex> lock(t.mu);
  out.state = t.state;
  out.error = t.error;
  out.ended_at = t.ended_at;
  out.bytes_total = t.bytes_total;
  for (const Chunk& c : t.chunks) out.bytes_done += c.control.bytes_done.load(std::memory_order_acquire);
  if (t.state == TransferState::kDone) out.bytes_done = t.bytes_total;
  return out;
}

TransferStatus Transfers::status(TransferId id) const {
  std::shared_ptr<Transfer> t = find(id);
  if (!t) {
    TransferStatus out;
    out.state = TransferState::kFailed;
    out.error = Status::not_found("transfer " + std::to_string(id) + " is unknown (never submitted, or released)");
    return out;
  }
  return status_of(*t);
}

TransferStatus Transfers::wait(TransferId id, std::chrono::milliseconds timeout) {
  std::shared_ptr<Transfer> t = find(id);
  if (!t) return status(id);
  const Clock::time_point now = Clock::now();
  // Saturates: a timeout too large for a time_point waits without limit.
  const bool forever = timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  const Clock::time_point until = forever ? Clock::time_point::max() : now + timeout;
  // Help only when this wait would last past the transfer's deadline anyway:
  // a run returns by then (Links watch the deadline, and so does the
  // notification), so running here never makes wait() overrun its timeout by
  // more than a Link takes to notice the deadline. run_chunk keeps the same
  // bookkeeping as on a worker (running, chunks_left, stop, finish_locked),
  // so cancel() still waits for these runs and the transfer ends once.
  if (until >= t->deadline) {
    while (std::optional<size_t> chunk = take_queued(*t)) run_chunk(t, *chunk);
  }
  {
    std::unique_lock<std::mutex> lock(t->mu);
    if (forever) {
      t->cv.wait(lock, [&] { return t->ended; });
    } else {
      t->cv.wait_until(lock, until, [&] { return t->ended; });
    }
  }
  return status_of(*t);
}

Status Transfers::cancel(TransferId id) {
  std::shared_ptr<Transfer> t = find(id);
  if (!t) return Status::not_found("transfer " + std::to_string(id) + " is unknown (never submitted, or released)");
  std::unique_lock<std::mutex> lock(t->mu);
  if (t->ended) return Status();
  stop_locked(*t, Status::cancelled(transfer_name(*t) + " was cancelled"), true);
  // The structural guarantee: return only when no run executes, and none can
  // start (workers test `stop` under this lock).
  t->cv.wait(lock, [&] { return t->running == 0; });
  finish_locked(*t);
  lock.unlock();
  after_end(t);
  return Status();
}

Status Transfers::release(TransferId id) {
  std::shared_ptr<Transfer> t = find(id);
  if (!t) return Status::not_found("transfer " + std::to_string(id) + " is unknown (never submitted, or released)");
  {
    std::lock_guard<std::mutex> lock(t->mu);
    if (!t->ended) return Status::unavailable("transfer " + std::to_string(id) + " is still in progress");
  }
  std::lock_guard<std::mutex> lock(mu_);
  table_.erase(id);
  if (t->has_deadline) {  // ended on a path that had not removed it yet
    deadlines_.erase(t->deadline_entry);
    t->has_deadline = false;
  }
  return Status();
}

void Transfers::fail_peer(uint64_t connection, const Status& why) {
  std::vector<std::shared_ptr<Transfer>> hit;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, t] : table_) {
      if (t->connection == connection) hit.push_back(t);
    }
  }
  for (auto& t : hit) {
    bool ended = false;
    {
      std::lock_guard<std::mutex> lock(t->mu);
      if (t->ended) continue;
      stop_locked(*t, why.with_context(transfer_name(*t)), false);
      if (t->running == 0) finish_locked(*t);
      ended = t->ended;
    }
    if (ended) after_end(t);
  }
}

Status Transfers::wait_peer(uint64_t connection, Clock::time_point deadline) {
  std::vector<std::shared_ptr<Transfer>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, t] : table_) {
      if (t->connection == connection) pending.push_back(t);
    }
  }
  for (auto& t : pending) {
    std::unique_lock<std::mutex> lock(t->mu);
    if (!t->cv.wait_until(lock, deadline, [&] { return t->ended; })) {
      return Status::timeout(transfer_name(*t) + " did not end before the deadline");
    }
  }
  return Status();
}

void Transfers::shutdown() {
  std::vector<std::shared_ptr<Transfer>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    for (auto& [id, t] : table_) all.push_back(t);
  }
  for (auto& t : all) {
    std::unique_lock<std::mutex> lock(t->mu);
    if (t->ended) continue;
    stop_locked(*t, Status::cancelled(transfer_name(*t) + " was cancelled: the engine is shutting down"), true);
    t->cv.wait(lock, [&] { return t->running == 0; });
    finish_locked(*t);
    lock.unlock();
    after_end(t);
  }
  {
    // Every run has returned; wait for their completion callbacks to leave.
    std::unique_lock<std::mutex> lock(async_mu_);
    async_cv_.wait(lock, [&] { return async_callbacks_ == 0; });
  }
  work_sem_.release(static_cast<uint32_t>(workers_.size()));
  timer_cv_.notify_all();
  for (std::thread& w : workers_) w.join();
  workers_.clear();
  if (timer_.joinable()) timer_.join();
}

}  // namespace kvbridge::engine_internal

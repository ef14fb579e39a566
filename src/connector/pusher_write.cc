// The pusher's writes: a stage's write submitted (start_write()), and
// submitted again after a backoff when the decode rank refused it as not
// granted yet (retry_due(), next_retry()), until its timeout; and a write's
// end (ended()), which tells the decode rank when it failed.
#include "connector/pusher.h"

#include <algorithm>
#include <utility>

namespace kvbridge::connector {

using Clock = std::chrono::steady_clock;
namespace {
// The longest wait between two tries of a write refused as not granted.
constexpr std::chrono::milliseconds kMaxGrantBackoff{20};
// A try of such a write is made only with at least this long left for it.
constexpr std::chrono::milliseconds kMinGrantTry{10};
}  // namespace

// Runs with no lock of ours held (or inside submit(), under mu_: its
// on_end takes only the acks' and the shared state's locks). A failed write
// tells the decode rank at once; a cancelled one was asked for. The
// callbacks hold only the engine, which outlives the worker, and shared
// state: a write may still be in flight when the worker goes.
void Pusher::start_write(const std::shared_ptr<Shared>& shared, Write w) {
  {
    std::lock_guard<std::mutex> lock(w.flight->mu);
    if (w.flight->cancelled) {
      ended(*shared->engine, *w.acks, shared->failures, w.peer, w.unwritten, shared->timeout, Status());
      return;
    }
  }
  SubmitOptions o = w.options;
  o.timeout = std::max(std::chrono::milliseconds(1),
                       std::chrono::duration_cast<std::chrono::milliseconds>(w.give_up - Clock::now()));
  // What the lines after submit() need: `w` moves into the callback.
  const PeerId peer = w.peer;
  const std::shared_ptr<const std::vector<TransferItem>> items = w.items;
  const std::shared_ptr<const std::vector<ItemRun>> runs = w.runs;
  const PreparedId list = w.list;
  const std::shared_ptr<Flight> flight = w.flight;
  const std::shared_ptr<Acks> acks = w.acks;
  const std::string unwritten = w.unwritten, what = w.what;
  o.on_end = [shared, w = std::move(w)](TransferId id, const TransferStatus& ts) mutable {
    (void)shared->engine->release(id);
    if (ts.state == TransferState::kFailed && ts.error.code() == Code::kPermissionDenied) {
      // Refused as not granted: the decode rank may not have planned the
      // load yet. Again after a while, unless it cancelled or time is up.
      const Clock::time_point now = Clock::now();
      bool cancelled = false;
      {
        std::lock_guard<std::mutex> lock(w.flight->mu);
        cancelled = w.flight->cancelled;
      }
      w.refused = ts.error;
      if (!cancelled && now + w.backoff + kMinGrantTry < w.give_up) {
        const Clock::time_point at = now + w.backoff;
        w.backoff = std::min(2 * w.backoff, kMaxGrantBackoff);
        {
          std::lock_guard<std::mutex> lock(shared->mu);
          shared->due.emplace_back(at, std::move(w));
        }
        shared->wake();
        return;
      }
    }
    Status error = ts.state == TransferState::kFailed ? ts.error : Status();
    // A last try that ran out of time after refusals fails for the refusal.
    if (error.code() == Code::kTimeout && !w.refused.ok()) error = w.refused;
    ended(*shared->engine, *w.acks, shared->failures, w.peer, w.unwritten, shared->timeout, error);
  };
  Result<TransferId> id = list != 0 ? shared->engine->submit_runs(list, *runs, std::move(o))
                          : runs    ? shared->engine->submit(peer, TransferOp::kWrite, *items, *runs, std::move(o))
                                    : shared->engine->submit(peer, TransferOp::kWrite, *items, std::move(o));
  if (!id.ok()) {
    ended(*shared->engine, *acks, shared->failures, peer, unwritten, shared->timeout, id.error().with_context(what));
    return;
  }
  bool cancelled = false;
  {
    std::lock_guard<std::mutex> lock(flight->mu);
    // A try that ended inside submit() may have been submitted again already.
    flight->id = std::max(flight->id, *id);
    cancelled = flight->cancelled;
  }
  // Cancelled between the check above and now: cancel() may have missed it.
  if (cancelled) (void)shared->engine->cancel(*id);
}

void Pusher::retry_due() {
  std::vector<Write> now_due;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    const Clock::time_point now = Clock::now();
    for (auto it = shared_->due.begin(); it != shared_->due.end();) {
      if (it->first <= now) {
        now_due.push_back(std::move(it->second));
        it = shared_->due.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Write& w : now_due) start_write(shared_, std::move(w));
}

Clock::time_point Pusher::next_retry() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  Clock::time_point next = Clock::time_point::max();
  for (const auto& [at, w] : shared_->due) next = std::min(next, at);
  return next;
}

void Pusher::ended(Engine& engine, Acks& acks, const std::shared_ptr<SendFailures>& failures, PeerId peer,
                   const std::string& unwritten, std::chrono::milliseconds timeout, const Status& error) {
  if (!error.ok()) {
    engine.notify(peer, unwritten, timeout, [failures](Status s) {
      if (!s.ok()) failures->add(s);
    });
  }
  {
    std::lock_guard<std::mutex> lock(acks.mu);
    if (!error.ok() && acks.first_error.ok()) acks.first_error = error;
    --acks.outstanding;
  }
  acks.cv.notify_all();
}

}  // namespace kvbridge::connector

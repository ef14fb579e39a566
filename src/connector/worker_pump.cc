// The worker's pump: it sleeps on the inbox (Wakeups) until a transfer
// ends, a notification arrives, a heartbeat is due or a load's deadline
// passes; it takes the sources' messages, ends loads and reports them, and
// sends heartbeats and done messages without waiting for them.
#include <algorithm>

#include "common/text.h"
#include "connector/worker_impl.h"

namespace kvbridge::connector {

// Sleeps until a transfer ends, a notification arrives, a heartbeat is
// due or a streamed load's deadline passes; ends loads; sends done
// messages and heartbeats (without waiting for their acknowledgements).
void WorkerImpl::pump() {
  Clock::time_point next_beat = Clock::now() + options_.heartbeat_interval;
  while (true) {
    Clock::time_point wake_at = next_beat;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (const auto& [id, load] : loads_) {
        if (load.unsubmitted > 0 && !load.expired) wake_at = std::min(wake_at, load.deadline);
      }
    }
    std::vector<Wakeups::Ended> ended;
    std::vector<Wakeups::Lost> lost;
    bool notes = false;
    {
      std::unique_lock<std::mutex> wl(wake_->mu);
      wake_->cv.wait_until(
          wl, wake_at, [&] { return !wake_->ended.empty() || wake_->poke || wake_->notes || !wake_->lost.empty(); });
      ended.swap(wake_->ended);
      lost.swap(wake_->lost);
      notes = std::exchange(wake_->notes, false);
      wake_->poke = false;
    }
    if (notes) drain_notifications();
    std::vector<std::pair<PeerId, std::string>> messages;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (const Wakeups::Ended& e : ended) {
        auto t = by_transfer_.find(e.id);
        if (t == by_transfer_.end()) continue;  // a load that failed to start
        auto it = loads_.find(t->second.first);
        const uint32_t k = t->second.second;
        by_transfer_.erase(t);
        if (it == loads_.end()) continue;
        Load& load = it->second;
        LoadStage& st = load.stages[k];
        load.last_byte = std::max(load.last_byte, e.at);
        st.landed_at = std::max(st.landed_at, e.at);
        --load.pending;
        if (!e.done) st.failed = true;
        if (--st.pending == 0 && !st.failed) land(load, st);
      }
      for (Wakeups::Lost& l : lost) {
        auto it = loads_.find(l.request);
        if (it == loads_.end() || !it->second.start_error.ok() || it->second.unsubmitted == 0) continue;
        it->second.start_error =
            l.error.with_context("request " + q(l.request) + ": " + l.source + ", which writes it, is gone");
      }
      const Clock::time_point now = Clock::now();
      for (auto it = loads_.begin(); it != loads_.end();) {
        Load& load = (it++)->second;
        if (load.unsubmitted > 0 && !load.expired && now >= load.deadline) load.expired = true;
        const bool over = load.aborted || load.expired || !load.start_error.ok() || load.unsubmitted == 0;
        if (load.pending > 0 || !over) continue;
        if (load.aborted && cancelling_.count(load.request) != 0) continue;  // push: abort() waits for the sources
        for (PeerId p : load.peers) {
          messages.emplace_back(p, format_message(Message::Kind::kDone, load.request));
        }
        end_load(loads_.find(load.request));
      }
      if (now >= next_beat) {
        next_beat = now + options_.heartbeat_interval;
        for (auto& [id, load] : loads_) {
          for (size_t k = 0; k < load.peers.size(); ++k) {
            if (load.push) {
              beat_push_source(load, k);
            } else {
              messages.emplace_back(load.peers[k], format_message(Message::Kind::kHeartbeat, id));
            }
          }
        }
        // Streams the engine never waited for are forgotten after a while.
        announcer_->forget_older_than(now - 4 * options_.transfer_timeout);
        pusher_->forget_older_than(now - 4 * options_.transfer_timeout);
      }
    }
    for (auto& [peer, m] : messages) send(peer, m);
  }
}

void WorkerImpl::drain_notifications() {
  std::vector<Notification> got = engine_.take_notifications();
  if (got.empty()) return;
  std::vector<std::pair<RequestId, EngineKey>> cancels;  // push, prefill side: handled outside the lock
  bool wake_pump = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Notification& n : got) {
      const std::optional<Message> m = parse_message(n.message);
      if (!m) continue;
      using Kind = Message::Kind;
      EngineKey engine{std::move(n.peer), n.peer_instance};
      if (m->kind == Kind::kHeartbeat || m->kind == Kind::kDone) {
        ReaderEvent e;
        e.kind = m->kind == Kind::kDone ? ReaderEvent::Kind::kDone : ReaderEvent::Kind::kHeartbeat;
        e.request = m->request;
        e.reader = std::move(engine.first);
        events_.push_back(std::move(e));
        continue;
      }
      if (m->kind == Kind::kCancel) {
        if (options_.mode == TransferMode::kPush) cancels.emplace_back(m->request, std::move(engine));
        continue;
      }
      if (m->kind == Kind::kCancelled) {
        auto c = cancelling_.find(m->request);
        if (c != cancelling_.end() && c->second.erase(engine) != 0) results_cv_.notify_all();
        continue;
      }
      Early e{std::move(engine), m->kind, m->stage, m->stages};
      if (m->kind == Kind::kReady) {
        auto o = ordinal_.find(std::string(m->layer));
        if (o == ordinal_.end()) continue;
        e.a = o->second;
      }
      const RequestId id = m->request;
      auto it = loads_.find(id);
      if (it == loads_.end()) {
        // After the load ended: dropped, so that nothing lands late. Before
        // it started: kept for it, the first kept going first past the bound.
        if (ended_.count(id) != 0) continue;
        while (early_count_ >= kEarlyKept && !early_order_.empty()) {
          auto first = early_.find(early_order_.front());
          early_order_.pop_front();
          if (first == early_.end()) continue;
          early_count_ -= first->second.size();
          early_.erase(first);
        }
        auto& kept = early_[id];
        if (kept.empty()) early_order_.push_back(id);
        kept.push_back(std::move(e));
        ++early_count_;
        continue;
      }
      take(it->second, e);
      wake_pump = !start_ready_stages(it->second).ok() || wake_pump;
      wake_pump = wake_pump || (it->second.push && (it->second.unsubmitted == 0 || !it->second.start_error.ok()));
    }
  }
  if (wake_pump) poke();  // the pump ends the load
  for (const auto& [request, engine] : cancels) pusher_->cancel(request, engine);
  if (!cancels.empty() && pusher_->unanswered()) {
    // A cancel from a rank of an instance not fetched yet: fetch them, then answer.
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& instance : remotes_->unfetched()) request_connect(instance);
  }
}

// Requires mu_: a message from `e.engine` about `load`: a layer announced
// (pull streaming), a stage written or not (push). Taken only from the
// engine of a source rank of the load's instance.
void WorkerImpl::take(Load& load, const Early& e) {
  if (e.kind == Message::Kind::kReady) {
    if (load.stream && !load.push) announce(load, e.engine, e.a);
    return;
  }
  if (!load.push || load.aborted) return;
  const auto& engines = load.fetched->engines;
  const size_t s = static_cast<size_t>(std::find(engines.begin(), engines.end(), e.engine) - engines.begin());
  if (s == engines.size()) return;
  if (e.b != load.stages.size()) {
    if (load.start_error.ok()) {
      load.start_error = Status::incompatible(
          "request " + q(load.request) + ": " + load.instance + " rank " + std::to_string(s) + " cut it into " +
          std::to_string(e.b) + " stages and this rank into " + std::to_string(load.stages.size()) +
          ": load_chunk_tokens and stream_layers_per_stage must be the same on both instances");
    }
    return;
  }
  LoadStage& st = load.stages[e.a];
  if (st.submitted || s >= st.items.size() || st.items[s].empty()) return;  // a repeat, or not a source of it
  if (e.kind == Message::Kind::kUnwritten) {
    st.failed = true;
    if (load.start_error.ok()) {
      load.start_error = Status::io_error("request " + q(load.request) + ": " + load.instance + " rank " +
                                          std::to_string(s) + " could not write stage " + std::to_string(e.a + 1) +
                                          " of " + std::to_string(e.b) + " (its wait_for_save() names the error)");
    }
    return;
  }
  st.items[s].clear();
  if (!written(st)) return;
  st.submitted = true;
  --load.unsubmitted;
  load.last_byte = std::max(load.last_byte, Clock::now());
  land(load, st);
}

// Requires mu_: `engine` announced `layer` (an ordinal) of `load`. Taken
// only from the engine of a source rank of the load's instance.
void WorkerImpl::announce(Load& load, const EngineKey& engine, uint32_t layer) {
  for (size_t s = 0; s < load.fetched->engines.size(); ++s) {
    if (load.fetched->engines[s] == engine) load.announced[s][layer] = 1;
  }
}

// Requires mu_: every transfer of `st` ended done.
void WorkerImpl::land(Load& load, LoadStage& st) {
  st.landed = true;
  for (uint32_t l = st.first_layer; l < st.end_layer; ++l) --load.layer_left[l];
  results_cv_.notify_all();
}

// Never blocks: the engine calls back when the peer acknowledged the
// message, or at its deadline, or when the peer is gone; a stopped peer
// delays nothing else.
// Requires mu_: a heartbeat to the k-th source of a push load. Only the
// source can write, so one that is gone (the engine says so: kIoError)
// fails the load at once rather than at its deadline.
void WorkerImpl::beat_push_source(const Load& load, size_t k) {
  const std::string source =
      load.fetched->infos[load.result.sources[k]].instance_id + " rank " + std::to_string(load.result.sources[k]);
  engine_.notify(load.peers[k], format_message(Message::Kind::kHeartbeat, load.request), options_.transfer_timeout,
                 [sent = sent_, wake = wake_, request = load.request, source](Status s) {
                   if (s.ok()) return;
                   sent->add(s);
                   if (s.code() != Code::kIoError) return;
                   {
                     std::lock_guard<std::mutex> lock(wake->mu);
                     wake->lost.push_back({request, source, std::move(s)});
                   }
                   wake->cv.notify_one();
                 });
}

// Requires mu_: the load is over (nothing in flight); reports it.
void WorkerImpl::end_load(std::map<RequestId, Load>::iterator it) {
  Load& load = it->second;
  finish(load);
  report(std::move(load.result));
  loads_.erase(it);
}

// Requires mu_: a queued load that never started ended with `error`
// (aborted, or its handshake, plan or submit failed); reports it.
void WorkerImpl::end_queued(const RequestId& request, uint64_t skip_tokens, Status error, bool aborted) {
  LoadResult r;
  r.request = request;
  r.error = std::move(error);
  r.aborted = aborted;
  r.first_bad_token = skip_tokens;
  ++(aborted ? stats_.loads_aborted : stats_.loads_failed);
  report(std::move(r));
}

// Requires mu_: `result` is a load's last word.
void WorkerImpl::report(LoadResult result) {
  ended_[result.request] = result.error;
  ended_order_.push_back(result.request);
  if (ended_order_.size() > kEndedKept) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  results_.push_back(std::move(result));
  results_cv_.notify_all();
}

// Requires mu_: nothing of `load` is in flight.
void WorkerImpl::finish(Load& load) {
  std::vector<TransferStatus> statuses;
  for (const LoadTransfer& t : load.transfers) {
    statuses.push_back(engine_.status(t.id));
    (void)engine_.release(t.id);
  }
  settle(load, statuses, order_, options_.transfer_timeout, Clock::now());
  if (load.aborted) {
    ++stats_.loads_aborted;
  } else if (load.result.error.ok()) {
    ++stats_.loads_ok;
  } else {
    ++stats_.loads_failed;
  }
}

}  // namespace kvbridge::connector

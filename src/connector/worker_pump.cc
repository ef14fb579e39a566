// The worker's pump: it sleeps on the inbox (Wakeups) until a transfer
// ends, a notification arrives, a heartbeat is due or a load's deadline
// passes; it takes the sources' messages, ends loads and reports them, and
// sends heartbeats and done messages without waiting for them.
#include <algorithm>

#include "common/text.h"
#include "common/thread_name.h"
#include "connector/worker_impl.h"

namespace kvbridge::connector {

// Sleeps until a transfer ends, a notification arrives, a heartbeat is
// due or a streamed load's deadline passes; ends loads; sends done
// messages and heartbeats (without waiting for their acknowledgements).
void WorkerImpl::pump() {
  Clock::time_point next_beat = Clock::now() + options_.heartbeat_interval;
  while (true) {
    Clock::time_point wake_at = std::min(next_beat, pusher_->next_retry());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (const auto& [id, load] : loads_) {
        if ((load.unsubmitted > 0 || load.confirming) && !load.expired) wake_at = std::min(wake_at, load.deadline);
        for (const Refused& r : load.refused) wake_at = std::min(wake_at, r.at);
      }
      for (const auto& [instance, jobs] : parked_) {
        for (const Job& job : jobs) wake_at = std::min(wake_at, job.called + options_.transfer_timeout);
      }
    }
    std::vector<Wakeups::Ended> ended;
    std::vector<Wakeups::Lost> lost;
    std::vector<Answer> answers;
    bool notes = false;
    {
      std::unique_lock<std::mutex> wl(wake_->mu);
      wake_->cv.wait_until(wl, wake_at, [&] {
        return !wake_->ended.empty() || wake_->poke || wake_->notes || !wake_->lost.empty() || !wake_->answers.empty();
      });
      ended.swap(wake_->ended);
      lost.swap(wake_->lost);
      answers.swap(wake_->answers);
      notes = std::exchange(wake_->notes, false);
      wake_->poke = false;
    }
    if (notes) drain_notifications();
    read_grants_->grant_waiting();  // pull prefill: readers heard for a hand-off, to grant (none most of the time)
    resender_->retry_due();         // dones and announcements to send again (none most of the time)
    pusher_->retry_due();           // pushed writes refused as not granted yet, to try again
    std::vector<std::pair<PeerId, std::string>> messages;
    std::vector<std::pair<PeerId, RequestId>> dones;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (const Wakeups::Ended& e : ended) {
        auto t = by_transfer_.find(e.id);
        if (t == by_transfer_.end()) continue;  // a load that failed to start
        auto it = loads_.find(t->second.first);
        const size_t index = t->second.second;
        by_transfer_.erase(t);
        if (it == loads_.end() || index >= it->second.transfers.size() || it->second.transfers[index].id != e.id) {
          continue;
        }
        Load& load = it->second;
        LoadTransfer& read = load.transfers[index];
        if (e.refused && !load.aborted && !load.expired) {
          // Not granted yet: the source grants this reader the request's
          // blocks once it has heard it and the hand-off; tried again
          // (1, 2, 4, ... 64 ms later) until the load's deadline.
          const Clock::time_point at = Clock::now() + std::chrono::milliseconds(1u << std::min(read.refusals, 6u));
          ++stats_.reads_refused;
          if (at < load.deadline) {
            ++read.refusals;
            load.refused.push_back({index, at});
            continue;
          }
        }
        load.last_byte = std::max(load.last_byte, e.at);
        --load.pending;
        for (uint32_t k : read.stages) {
          LoadStage& st = load.stages[k];
          st.landed_at = std::max(st.landed_at, e.at);
          if (!e.done) st.failed = true;
          if (--st.pending == 0 && !st.failed) land(load, st);
        }
      }
      for (Wakeups::Lost& l : lost) {
        auto it = loads_.find(l.request);
        if (it == loads_.end() || !it->second.start_error.ok() || it->second.unsubmitted == 0) continue;
        it->second.start_error =
            l.error.with_context("request " + q(l.request) + ": " + l.source + ", which writes it, is gone");
      }
      for (Answer& a : answers) take_answer(a);
      const Clock::time_point now = Clock::now();
      expire_parked(now);
      for (auto it = loads_.begin(); it != loads_.end();) {
        Load& load = (it++)->second;
        if (!load.refused.empty()) submit_refused(load, now);
        if (load.confirming && !load.unconfirmed.empty() && load.confirm_error.ok() && now >= load.deadline) {
          load.confirm_error =
              Status::timeout("request " + q(load.request) + ": " + load.instance + " did not say within " +
                              std::to_string(options_.transfer_timeout.count()) +
                              " ms whether the blocks read were still the request's");
        }
        if (load.unsubmitted > 0 && !load.expired && now >= load.deadline) load.expired = true;
        const bool over = load.aborted || load.expired || !load.start_error.ok() || load.unsubmitted == 0;
        if (load.pending > 0 || !over) continue;
        if (load.aborted && cancelling_.count(load.request) != 0) continue;  // push: abort() waits for the sources
        const bool landed =
            std::all_of(load.stages.begin(), load.stages.end(), [](const LoadStage& st) { return st.landed; });
        if (!load.push && !load.aborted && !load.expired && load.start_error.ok() && landed && !load.peers.empty()) {
          // Every byte landed: ok once each source read says its blocks
          // were still the request's (its done's answer).
          if (!load.confirming) {
            confirm(load, &dones);
            continue;
          }
          if (!load.unconfirmed.empty() && load.confirm_error.ok()) continue;
        } else if (!load.confirming) {
          for (PeerId p : load.told) dones.emplace_back(p, load.request);
        }
        end_load(loads_.find(load.request));
      }
      if (now >= next_beat) {
        next_beat = now + options_.heartbeat_interval;
        for (auto& [id, load] : loads_) {
          if (load.push) {
            for (size_t k = 0; k < load.peers.size(); ++k) beat_push_source(load, k);
          } else if (!load.confirming) {
            for (PeerId p : load.told) messages.emplace_back(p, reader_message(Message::Kind::kHeartbeat, id));
          }
        }
        // Streams the engine never waited for are forgotten after a while.
        announcer_->forget_older_than(now - 4 * options_.transfer_timeout);
        pusher_->forget_older_than(now - 4 * options_.transfer_timeout);
      }
    }
    for (auto& [peer, m] : messages) send(peer, m);
    for (auto& [peer, request] : dones) send_done(peer, request);
  }
}

void WorkerImpl::drain_notifications() {
  std::vector<Notification> got = engine_.take_notifications();
  if (got.empty()) return;
  std::vector<std::pair<RequestId, EngineKey>> cancels;  // push, prefill side: handled outside the lock
  std::vector<std::pair<RequestId, EngineKey>> heard;    // pull, prefill side: readers that may read
  bool wake_pump = false;
  std::vector<RequestId> touched;  // loads a message was about, in arrival order
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Notification& n : got) {
      const std::optional<Message> m = parse_message(n.message);
      if (!m) continue;
      using Kind = Message::Kind;
      EngineKey engine{std::move(n.peer), n.peer_instance};
      if (m->kind == Kind::kHeartbeat || m->kind == Kind::kDone) {
        if (m->kind == Kind::kHeartbeat) heard.emplace_back(m->request, engine);
        ReaderEvent e;
        e.kind = m->kind == Kind::kDone ? ReaderEvent::Kind::kDone : ReaderEvent::Kind::kHeartbeat;
        e.request = m->request;
        e.reader = std::move(engine.first);
        e.readers = m->readers;
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
      // The rest are about a load; answers (held, released, unread) never
      // come as notifications.
      if (m->kind != Kind::kReady && m->kind != Kind::kWrote && m->kind != Kind::kUnwritten) continue;
      Early e{std::move(engine), m->kind, m->stage, m->stages, m->event, m->where};
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
      if (std::find(touched.begin(), touched.end(), id) == touched.end()) touched.push_back(id);
    }
    // Each load a message was about starts what became ready, once for all
    // of this batch's messages: layers announced together are read
    // together (one read per source), not one read each.
    for (const RequestId& id : touched) {
      auto it = loads_.find(id);
      if (it == loads_.end()) continue;
      // A streamed pull load looks again only when an announcement may
      // have made a stage ready.
      const Load& load = it->second;
      if (load.stream && !load.push && load.looked && load.to_look_at.empty()) continue;
      const std::chrono::nanoseconds cpu0 = thread_cpu_time();
      wake_pump = !start_ready_stages(it->second).ok() || wake_pump;
      it->second.submit_cpu += thread_cpu_time() - cpu0;
      wake_pump = wake_pump || (it->second.push && (it->second.unsubmitted == 0 || !it->second.start_error.ok()));
    }
  }
  if (wake_pump) poke();  // the pump ends the load
  for (const auto& [request, engine] : heard) read_grants_->heard(request, engine);
  if (!heard.empty()) poke();  // the pump grants them (this may be an engine's thread: take_reader_events)
  for (const auto& [request, engine] : cancels) pusher_->cancel(request, engine);
  if (!cancels.empty() && pusher_->unanswered()) {
    // A cancel from a rank of an instance not fetched yet: fetch them, then answer.
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& instance : remotes_->unfetched()) request_connect(instance);
  }
}

// Requires mu_: loads still waiting for their instance's connect attempt
// when their transfer timeout passed fail now, naming it (the attempt goes
// on for the loads after them). Aborted ones stay: the attempt's end
// settles what they owe their sources.
void WorkerImpl::expire_parked(Clock::time_point now) {
  for (auto& [instance, jobs] : parked_) {
    for (auto j = jobs.begin(); j != jobs.end();) {
      auto qd = queued_.find(j->request);
      if (now < j->called + options_.transfer_timeout || qd == queued_.end() || qd->second.gen != j->gen) {
        ++j;
        continue;
      }
      queued_.erase(qd);
      end_queued(j->request, j->blocks.skip_tokens,
                 Status::timeout("request " + q(j->request) + ": " + Remotes::instance_of(instance) +
                                 " was still being connected to (its handshake) when the load's " +
                                 std::to_string(options_.transfer_timeout.count()) + " ms transfer timeout passed"),
                 false);
      j = jobs.erase(j);
    }
  }
}

// Requires mu_: a message from `e.engine` about `load`: a layer announced
// (pull streaming), a stage written or not (push). Taken only from the
// engine of a source rank of the load's instance.
void WorkerImpl::take(Load& load, const Early& e) {
  if (e.kind == Message::Kind::kReady) {
    if (load.stream && !load.push) announce(load, e.engine, e.a, e.event);
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
  if (st.submitted || !st.reads(s)) return;  // a repeat, or not a source of it
  if (e.kind == Message::Kind::kUnwritten) {
    st.failed = true;
    if (load.start_error.ok()) {
      load.start_error = Status::io_error("request " + q(load.request) + ": " + load.instance + " rank " +
                                          std::to_string(s) + " could not write stage " + std::to_string(e.a + 1) +
                                          " of " + std::to_string(e.b) + " (its wait_for_save() names the error)");
    }
    return;
  }
  if (s >= st.where.size() || st.where[s] != e.where) {
    // The source wrote this stage to other places than this load's plan
    // (told other block ids than start_load() named, or another layout):
    // the blocks this load named were not written, so it fails, naming
    // both. (Writes outside this rank's grant are refused where the
    // transport can: docs/security.md.)
    st.failed = true;
    if (load.start_error.ok()) {
      const std::string stage = " wrote stage " + std::to_string(e.a + 1) + " of " + std::to_string(e.b);
      const bool form = s < st.where.size() && places_of_runs(st.where[s]) != places_of_runs(e.where);
      load.start_error = Status::incompatible(
          "request " + q(load.request) + ": " + load.instance + " rank " + std::to_string(s) + stage +
          (form
               ? std::string(" as ") + (places_of_runs(e.where) ? "runs over items" : "items alone") +
                     " where this rank planned it as " + (places_of_runs(e.where) ? "items alone" : "runs over items") +
                     " (one side planned the request's shape afresh, the other from its template: is one of them "
                     "another version?)"
               : " to other places than this load's blocks (was it given other block ids than start_load() named?)"));
    }
    return;
  }
  st.items[s].clear();
  if (st.from != LoadStage::kNotMoved) st.runs[s].clear();  // its items are the other stage's
  if (!written(st)) return;
  st.submitted = true;
  --load.unsubmitted;
  load.last_byte = std::max(load.last_byte, Clock::now());
  land(load, st);
}

// Requires mu_: `engine` announced `layer` (an ordinal) of `load`. Taken
// only from the engine of a source rank of the load's instance.
void WorkerImpl::announce(Load& load, const EngineKey& engine, uint32_t layer, const std::string& event) {
  for (size_t s = 0; s < load.fetched->engines.size(); ++s) {
    if (load.fetched->engines[s] != engine || load.announced[s][layer] != 0) continue;
    load.announced[s][layer] = 1;
    load.events[s][layer] = event;
    // Only a stage that reads this source may have become ready.
    if (layer < load.stages_of_layer.size()) {
      for (uint32_t k : load.stages_of_layer[layer]) {
        if (load.stages[k].reads(s)) load.to_look_at.push_back(k);
      }
    }
  }
}

std::string WorkerImpl::reader_message(Message::Kind kind, const RequestId& request) const {
  Message m;
  m.kind = kind;
  m.request = request;
  m.readers = readers_;
  return format_message(m);
}

void WorkerImpl::confirm(Load& load, std::vector<std::pair<PeerId, RequestId>>* dones) {
  load.confirming = true;
  for (size_t i = 0; i < load.peers.size(); ++i) {
    const EngineKey engine = load.fetched->engines[load.result.sources[i]];
    load.unconfirmed.insert(engine);
    // Asked again while a try goes unanswered (a lost done), until the
    // load's deadline. The answer may come on this thread (a peer already
    // gone): it only queues it for the pump.
    resender_->send(load.peers[i], reader_message(Message::Kind::kDone, load.request), load.deadline,
                    [wake = wake_, request = load.request, engine](Status s, std::string answer) {
                      {
                        std::lock_guard<std::mutex> lock(wake->mu);
                        wake->answers.push_back(Answer{request, engine, std::move(s), std::move(answer)});
                      }
                      wake->cv.notify_one();
                    });
  }
  for (PeerId p : load.told) {
    if (std::find(load.peers.begin(), load.peers.end(), p) == load.peers.end()) dones->emplace_back(p, load.request);
  }
}

void WorkerImpl::take_answer(Answer& a) {
  auto it = loads_.find(a.request);
  if (it == loads_.end()) return;
  Load& load = it->second;
  if (!load.confirming || load.unconfirmed.count(a.engine) == 0 || !load.confirm_error.ok()) return;
  load.unconfirmed.erase(a.engine);
  const std::optional<Message> m = parse_message(a.answer);
  const bool held = a.status.ok() && m && m->kind == Message::Kind::kHeld && m->request == a.request;
  if (held) return;
  const std::string who = "request " + q(a.request) + ": " + load.instance + " engine " + q(a.engine.first);
  if (!a.status.ok()) {
    load.confirm_error = a.status.with_context(who + " could not say whether the blocks read were still the request's");
  } else if (m && m->kind == Message::Kind::kReleased && m->request == a.request) {
    load.confirm_error = Status::unavailable(
        who +
        " had released the request's blocks (its lease expired, or it was aborted) when the read ended: "
        "what was read may be another request's");
  } else {
    load.confirm_error =
        Status::internal(who + " answered the done with " + q(printable(a.answer, 80)) + ", not held or released");
  }
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
  engine_.notify(load.peers[k], reader_message(Message::Kind::kHeartbeat, load.request), options_.transfer_timeout,
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

}  // namespace kvbridge::connector

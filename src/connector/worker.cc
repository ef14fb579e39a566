// ConnectorWorker::create and the worker's public methods: remotes, loads
// queued for the start thread, aborts, streaming and push hooks
// (worker_impl.h says where the rest lives; registration is in
// worker_init.cc).
#include "common/text.h"
#include "connector/worker_impl.h"
#include "kvbridge/plan.h"
#include "net/address.h"

namespace kvbridge {
namespace connector {

void Released::add(RequestId request, const std::vector<std::string>& readers_done) {
  std::lock_guard<std::mutex> lock(mu);
  auto [it, added] = ids.try_emplace(request);
  it->second.insert(readers_done.begin(), readers_done.end());
  if (!added) return;
  order.push_back(std::move(request));
  if (order.size() > kKept) {
    ids.erase(order.front());
    order.pop_front();
  }
}

bool Released::released_for(const RequestId& request, const std::string& reader) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = ids.find(request);
  return it != ids.end() && it->second.count(reader) == 0;
}

Status WorkerImpl::add_remote(const std::string& instance, std::vector<std::string> rank_addresses) {
  KVB_ASSIGN_OR_RETURN(bool changed, remotes_->add(instance, std::move(rank_addresses)));
  (void)changed;  // loads under way keep their snapshot; the next ones handshake with the new ranks
  return Status();
}

Status WorkerImpl::remove_remote(const std::string& instance) {
  KVB_RETURN_IF_ERROR(remotes_->remove(instance));
  std::lock_guard<std::mutex> lock(mu_);
  // Loads parked for its connect (at any of its keys) will not get one: they
  // fail now.
  for (auto parked = parked_.begin(); parked != parked_.end();) {
    if (Remotes::instance_of(parked->first) != instance) {
      ++parked;
      continue;
    }
    for (Job& job : parked->second) {
      auto qd = queued_.find(job.request);
      if (qd == queued_.end() || qd->second.gen != job.gen) continue;
      queued_.erase(qd);
      end_queued(job.request, job.blocks.skip_tokens,
                 Status::not_found("request " + q(job.request) + ": remote instance " + q(instance) +
                                   " was removed before the load started"),
                 false);
    }
    parked = parked_.erase(parked);
  }
  return Status();
}

void WorkerImpl::blocks_released(RequestId request, const std::vector<std::string>& readers_done) {
  read_grants_->released(request);
  released_->add(std::move(request), readers_done);
}

Status WorkerImpl::hand_off(RequestId request, const std::map<std::string, std::vector<int64_t>>& blocks) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  KVB_ASSIGN_OR_RETURN(bool waiting, read_grants_->hand_off(request, blocks));
  if (waiting) poke();  // readers heard before it: the pump grants them
  return Status();
}

Result<std::vector<connector_internal::RemoteRankView>> WorkerImpl::remote_ranks(const std::string& instance) const {
  std::shared_ptr<const Fetched> f = remotes_->fetched(instance);
  if (!f) return Status::not_found("no handshake with instance '" + instance + "' yet");
  std::vector<connector_internal::RemoteRankView> out;
  for (size_t r = 0; r < f->infos.size(); ++r) {
    connector_internal::RemoteRankView v{f->layouts[r], f->infos[r].pid, {}};
    for (const TensorRegion& t : f->infos[r].tensors) v.tensor_bases.push_back(t.base);
    out.push_back(std::move(v));
  }
  return out;
}

Status WorkerImpl::connect(const std::string& instance) {
  if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
  if (remotes_->connected(instance)) return Status();
  std::lock_guard<std::mutex> lock(mu_);
  request_connect(instance);
  return Status();
}

Status WorkerImpl::wait_connected(const std::string& instance, std::chrono::milliseconds timeout) {
  KVB_RETURN_IF_ERROR(connect(instance));
  std::unique_lock<std::mutex> lock(mu_);
  Status out =
      Status::timeout("instance " + q(instance) + " not connected within " + std::to_string(timeout.count()) + " ms");
  results_cv_.wait_for(lock, timeout, [&] {
    if (remotes_->connected(instance)) {
      out = Status();
      return true;
    }
    auto e = connect_errors_.find(instance);
    if (e == connect_errors_.end() || connecting_.count(instance) != 0) return false;
    out = e->second;
    return true;
  });
  return out;
}

Status WorkerImpl::start_load(RequestId request, const std::string& instance, const Request& blocks,
                              const LoadOptions& options) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
  // The hand-off's addresses, when it named others than the instance's.
  KVB_ASSIGN_OR_RETURN(std::string remote, remotes_->route(instance, options.addresses));
  // Planning, submitting and any handshake run on the worker's threads.
  Job job{request, std::move(remote), blocks, options, 0, Clock::now()};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (loads_.count(request) != 0 || queued_.count(request) != 0) {
      return Status::already_exists("request " + q(request) + " is loading");
    }
    job.gen = ++queued_gen_;
    queued_[request] = Queued{job.gen, blocks.skip_tokens, job.instance};
    jobs_.push_back(std::move(job));
  }
  jobs_cv_.notify_one();  // after the lock: the start thread does not wake into it
  return Status();
}

Status WorkerImpl::wait_for_layer(RequestId request, std::string_view layer, std::chrono::milliseconds timeout) {
  auto o = ordinal_.find(std::string(layer));
  if (o == ordinal_.end()) return Status::invalid_argument("no layer " + q(layer) + " in this rank's layout");
  std::unique_lock<std::mutex> lock(mu_);
  Status out = Status::timeout("request " + q(request) + ": " + q(layer) + " did not land within " +
                               std::to_string(timeout.count()) + " ms");
  auto landed = [&] {
    if (queued_.count(request) != 0) return false;  // not started yet
    auto it = loads_.find(request);
    if (it != loads_.end()) {
      if (it->second.layer_left[o->second] != 0) return false;
      out = Status();
      return true;
    }
    auto e = ended_.find(request);
    if (e == ended_.end()) {
      out = Status::not_found("request " + q(request) + " is not loading");
      return true;
    }
    out = e->second;
    return true;
  };
  // A poll (0) looks without a timed wait, which costs a futex call and
  // the timer slack.
  if (timeout.count() <= 0) {
    (void)landed();
  } else {
    results_cv_.wait_for(lock, timeout, landed);
  }
  return out;
}

Status WorkerImpl::abort(RequestId request) {
  std::vector<TransferId> ids;
  std::string push_instance;            // push mode: the sources to ask to cancel
  std::optional<Sources> push_sources;  // of a started load; a queued one's are found later
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto qd = queued_.find(request); qd != queued_.end()) {
      // Not started: it never will be, and its result is ready now. The
      // prefill ranks it would have read still hold its blocks: once the
      // instance is connected the start thread tells them it is done.
      const uint64_t skip = qd->second.skip_tokens;
      abandoned_[request] = qd->second.gen;
      if (options_.mode == TransferMode::kPush) push_instance = qd->second.instance;
      queued_.erase(qd);
      end_queued(request, skip, Status::cancelled("request " + q(request) + " was aborted"), true);
    } else {
      auto it = loads_.find(request);
      if (it == loads_.end()) return Status::not_found("request " + q(request) + " is not loading");
      Load& load = it->second;
      load.aborted = true;  // no stage starts any more
      for (const LoadTransfer& t : load.transfers) ids.push_back(t.id);
      if (load.push) {
        push_instance = load.remote;
        push_sources.emplace();
        for (uint32_t s : load.result.sources) push_sources->engines.insert(load.fetched->engines[s]);
        push_sources->peers = load.peers;
        cancelling_[request] = push_sources->engines;  // the pump keeps the load until abort() is done
      }
    }
  }
  // cancel() returns once no byte of the transfer can land any more.
  for (TransferId t : ids) KVB_RETURN_IF_ERROR(engine_.cancel(t));
  Status out;
  if (!push_instance.empty()) out = cancel_sources(request, push_instance, std::move(push_sources));
  poke();  // a load with nothing in flight ends now
  return out;
}

// Push mode: the sources write, so only they can stop: each is asked to
// cancel ("kvb/1 cancel"), and answers once none of its writes can land.
// Waits for every answer, up to the handshake timeout. `sources`: the
// engines and peers of a started load; none: of a load aborted while
// queued, which may already be written to (its sources as plans choose
// them, once the instance is connected).
Status WorkerImpl::cancel_sources(const RequestId& request, const std::string& instance,
                                  std::optional<Sources> sources) {
  const auto deadline = Clock::now() + options_.handshake_timeout;
  const std::string within = " within " + std::to_string(options_.handshake_timeout.count()) + " ms";
  if (!sources) {
    Status c = wait_connected(instance, options_.handshake_timeout);
    if (!c.ok()) {
      return Status::timeout("request " + q(request) + ": cannot ask " + instance +
                             " to cancel (not connected: " + c.message() + "); bytes it writes may still land");
    }
    Result<Sources> found = planned_sources(instance);
    if (!found.ok()) return found.error();
    if (!found->unreachable.ok()) return found->unreachable;
    sources = std::move(*found);
    std::lock_guard<std::mutex> lock(mu_);
    cancelling_[request] = sources->engines;
  }
  for (PeerId p : sources->peers) send(p, format_message(Message::Kind::kCancel, request));
  std::unique_lock<std::mutex> lock(mu_);
  const bool all = results_cv_.wait_until(lock, deadline, [&] {
    auto c = cancelling_.find(request);
    return stop_ || c == cancelling_.end() || c->second.empty();
  });
  Status out;
  if (!all) {
    std::string who;
    for (const EngineKey& e : cancelling_[request]) who += (who.empty() ? "" : ", ") + q(e.first);
    out = Status::timeout("request " + q(request) + ": " + instance + " engine(s) " + who +
                          " did not confirm the cancel" + within + "; bytes they already wrote may still land");
  }
  cancelling_.erase(request);
  return out;
}

std::vector<LoadResult> WorkerImpl::take_results() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<LoadResult> out;
  out.swap(results_);
  return out;
}

void WorkerImpl::wait_results(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  results_cv_.wait_for(lock, timeout, [&] { return !results_.empty(); });
}

std::vector<ReaderEvent> WorkerImpl::take_reader_events() {
  drain_notifications();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReaderEvent> out;
  out.swap(events_);
  return out;
}

Status WorkerImpl::stream_to(RequestId request, const std::string& instance) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (options_.mode == TransferMode::kPush) {
    return Status::invalid_argument("stream_to() is for pull mode; in push mode push() names the instance");
  }
  if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
  return announcer_->stream_to(request, instance);
}

Status WorkerImpl::save_layer(RequestId request, std::string_view layer, const Readiness& ready) {
  if (options_.mode == TransferMode::kPush) return pusher_->save_layer(request, layer, ready);
  if (ready.event != 0 && ready.event_handle.empty() && !ready.host_synchronized) {
    return Status::invalid_argument("layer " + q(layer) + " of request " + q(request) +
                                    ": in pull mode the readers are other processes, which wait on an interprocess "
                                    "event: give Readiness::event_handle, not an event of this process");
  }
  return announcer_->save_layer(request, layer, ready);
}

Status WorkerImpl::wait_for_save(RequestId request, std::chrono::milliseconds timeout) {
  if (options_.mode == TransferMode::kPush) return pusher_->wait_for_save(request, timeout);
  return announcer_->wait_for_save(request, timeout);
}

Status WorkerImpl::push(RequestId request, const std::string& instance, const Request& blocks,
                        const LoadOptions& options) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (options_.mode != TransferMode::kPush) {
    return Status::invalid_argument("push() needs a worker in push mode (WorkerOptions::mode); this one pulls");
  }
  if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
  return pusher_->push(std::move(request), instance, blocks, options);
}

WorkerStats WorkerImpl::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  WorkerStats s = stats_;
  {
    std::lock_guard<std::mutex> sent_lock(sent_->mu);
    s.notifications_failed = sent_->failed;
    s.last_notification_error = sent_->last_error;
  }
  const StageCache::Stats planned = stage_cache_.stats();
  s.plan_templates = planned.built;
  s.plans_from_templates = planned.instantiated;
  s.plans_not_templated = planned.fresh;
  s.plan_template_fallback = planned.fallback_reason;
  s.move_tables_kept = move_tables_.size();
  s.prepared_lists_held = lists_held_.load(std::memory_order_relaxed);
  s.writes_as_runs = pusher_ ? pusher_->writes_as_runs() : 0;
  s.moved_stage_writes = pusher_ ? pusher_->moved_stage_writes() : 0;
  s.announcements_sent = announcer_ ? announcer_->announcements_sent() : 0;
  s.announcements_skipped = announcer_ ? announcer_->announcements_skipped() : 0;
  if (pusher_) {
    s.prepared_lists += pusher_->lists_prepared();
    s.prepared_lists_held += pusher_->lists_held();
  }
  s.handshakes = remotes_->handshakes();
  s.handshakes_served = server_->served();
  s.handshakes_rejected = server_->rejected();
  s.last_rejection = server_->last_rejection();
  return s;
}

void WorkerImpl::poke() {
  {
    std::lock_guard<std::mutex> lock(wake_->mu);
    wake_->poke = true;
  }
  wake_->cv.notify_all();
}

void WorkerImpl::send(PeerId peer, const std::string& message) {
  // The callback may outlive the worker (a peer that never answers): it
  // holds only the counters.
  engine_.notify(peer, message, options_.transfer_timeout, [sent = sent_](Status s) {
    if (!s.ok()) sent->add(s);
  });
}

void WorkerImpl::send_done(PeerId peer, const RequestId& request) {
  // A lost done would hold the prefill's blocks for a whole lease: it is
  // sent again until acknowledged (the prefill counts a reader once).
  resender_->send(peer, reader_message(Message::Kind::kDone, request), Clock::now() + options_.transfer_timeout,
                  [sent = sent_](Status s, std::string) {
                    if (!s.ok()) sent->add(s);
                  });
}

}  // namespace connector

Result<std::unique_ptr<ConnectorWorker>> ConnectorWorker::create(Engine& engine, const Layout& layout,
                                                                 std::span<const std::span<uint8_t>> tensors,
                                                                 const WorkerOptions& options) {
  KVB_RETURN_IF_ERROR(validate(layout).with_context("worker layout"));
  KVB_RETURN_IF_ERROR(net::check_advertised(options.side_channel_host, options.side_channel_advertise_host,
                                            "side channel host", "side_channel_advertise_host"));
  if (engine.has_secret() != !options.secret.empty()) {
    return Status::invalid_argument(
        engine.has_secret() ? "the engine has a shared secret but the worker has none: give both the same"
                            : "the worker has a shared secret but its engine has none (EngineOptions::secret): "
                              "give both the same");
  }
  auto w = std::make_unique<connector::WorkerImpl>(engine, layout, options);
  KVB_RETURN_IF_ERROR(w->init(tensors));
  return std::unique_ptr<ConnectorWorker>(std::move(w));
}

namespace connector_internal {

Result<std::vector<RemoteRankView>> remote_ranks(const ConnectorWorker& worker, const std::string& instance) {
  const auto* impl = dynamic_cast<const connector::WorkerImpl*>(&worker);
  if (impl == nullptr) return Status::invalid_argument("not a worker made by ConnectorWorker::create");
  return impl->remote_ranks(instance);
}

}  // namespace connector_internal
}  // namespace kvbridge

// The worker's start thread: plans each queued load (after its instance's
// handshake), checks it with the verifier when asked, prepares what its
// reads take, and starts the stages whose layers are ready (worker_read.cc).
#include <algorithm>
#include <optional>

#include "common/text.h"
#include "common/thread_name.h"
#include "connector/worker_impl.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"

namespace kvbridge::connector {

// The start thread: plans and starts the queued loads, in order; one
// whose instance is not connected waits (parked) for the connect thread.
void WorkerImpl::start_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    jobs_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    if (abandoned(job.request, job.gen) && remotes_->connected(job.instance)) {
      abandoned_.erase(job.request);
      lock.unlock();
      release_sources(job.instance, job.request);
      lock.lock();
      continue;
    }
    if (!remotes_->connected(job.instance)) {
      ++stats_.loads_queued;
      request_connect(job.instance);
      parked_[job.instance].push_back(std::move(job));
      continue;
    }
    lock.unlock();
    Status s = start_now(job.request, job.instance, job.blocks, job.options, job.gen, job.called);
    lock.lock();
    auto qd = queued_.find(job.request);
    if (!s.ok() && qd != queued_.end() && qd->second.gen == job.gen) {
      queued_.erase(qd);
      end_queued(job.request, job.blocks.skip_tokens, std::move(s), false);
    }
    if (abandoned(job.request, job.gen)) {  // aborted while it was being planned
      abandoned_.erase(job.request);
      lock.unlock();
      release_sources(job.instance, job.request);
      lock.lock();
    }
  }
}

// Plans and starts the queued load of generation `gen` (on the start
// thread, its instance connected), if it is still queued (not aborted).
Status WorkerImpl::start_now(const RequestId& request, const std::string& instance, const Request& blocks,
                             const LoadOptions& options, uint64_t gen, Clock::time_point called) {
  const std::chrono::nanoseconds cpu0 = thread_cpu_time();
  const std::string remote = instance;  // the key in Remotes
  const std::string name = Remotes::instance_of(remote);
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_->fetch(remote));
  if (!options.incarnations.empty()) {
    // The hand-off named the ranks that hold the request's KV; a snapshot
    // older than the hand-off is fetched again, and a rank that is another
    // process now (it restarted) does not hold it.
    auto mismatch = [&](const Fetched& f) -> std::optional<size_t> {
      if (options.incarnations.size() != f.infos.size()) return f.infos.size();
      for (size_t r = 0; r < f.infos.size(); ++r) {
        if (f.incarnation(r) != options.incarnations[r]) return r;
      }
      return std::nullopt;
    };
    if (mismatch(*fetched)) {
      remotes_->invalidate(remote, fetched.get());
      KVB_ASSIGN_OR_RETURN(fetched, remotes_->fetch(remote));
    }
    if (std::optional<size_t> r = mismatch(*fetched)) {
      if (options.incarnations.size() != fetched->infos.size()) {
        return Status::incompatible("request " + q(request) + " was handed off by " +
                                    std::to_string(options.incarnations.size()) + " ranks of " + q(name) +
                                    ", which has " + std::to_string(fetched->infos.size()) + " now");
      }
      return Status::unavailable("request " + q(request) + " was handed off by " + q(name) + " rank " +
                                 std::to_string(*r) + " incarnation " + printable(options.incarnations[*r], 40) +
                                 ", and that rank is incarnation " + fetched->incarnation(*r) +
                                 " now (it restarted: the request's KV went with the old process)");
    }
  }
  // Planning (and verifying) runs outside the lock, on the immutable snapshot.
  const std::vector<Layout>& layouts = fetched->layouts;
  StageOptions so;
  so.layers_per_stage = options.stream ? options_.stream_layers_per_stage : 0;
  // A streamed load is cut by layers only: a layer range's chunks become
  // ready together and would be read (written) together. The sources of a
  // push load cut it as this rank does (chunk_tokens_of(), load.h).
  so.chunk_tokens = chunk_tokens_of(options.stream, options_.load_chunk_tokens);
  uint64_t naive = 0;
  // A streamed load takes its later layers' stages as its first layer's
  // moved (pull: read as runs of that stage's items, prepared once; push:
  // granted as repeats of its places). A push load is planned from its
  // shape's template from the shape's first load on, as its sources plan
  // it: both sides then give each stage's places in one form
  // (write_places()).
  const bool push = options_.mode == TransferMode::kPush;
  KVB_ASSIGN_OR_RETURN(std::vector<CompactStage> stages,
                       stage_cache_.compact_stages(layout_, nullptr, layouts, fetched, blocks, so, &naive,
                                                   /*moved=*/options.stream, /*from_first=*/push));
  if (options_.verify_plans) {
    // The verifier's independent rules on simulated memory: a plan that
    // would move one wrong byte is refused before anything moves. The
    // stages together are the request's plan (minimal when there is one).
    Plan all;
    for (size_t k = 0; k < stages.size(); ++k) {
      Plan p = expand(stages, k);
      all.descriptors.insert(all.descriptors.end(), p.descriptors.begin(), p.descriptors.end());
    }
    Result<VerifyReport> v = verify(all, layout_, layouts, blocks, /*check_minimal=*/stages.size() == 1);
    std::lock_guard<std::mutex> stats_lock(mu_);
    if (!v.ok()) {
      ++stats_.plans_rejected;
      return v.error().with_context("request " + q(request) + ": plan from " + instance + " failed verification");
    }
    ++stats_.plans_verified;
  }
  Load load;
  load.request = request;
  load.instance = name;
  load.remote = remote;
  load.fetched = fetched;
  load.stream = options.stream;
  load.push = push;
  load.ready = options.ready;
  load.result.request = request;
  load.result.naive_descriptors = naive;
  load.result.stages = static_cast<uint32_t>(stages.size());
  load.used.assign(layouts.size(), false);
  load.layer_left.assign(order_.size(), 0);
  // Per stage, one batch per source rank, in the plan's (local address)
  // order, as items and the runs that repeat them: pull reads it so; push
  // grants its places and compares their hash with what the sources say
  // they wrote.
  const LoadTensors tensors(regions_, layout_, fetched->infos, layouts);
  // Per stage others are moved from: its literal runs' items per source.
  std::vector<uint8_t> moved_from(stages.size(), 0);
  for (const CompactStage& s : stages) {
    if (s.moved_from >= 0) moved_from[static_cast<size_t>(s.moved_from)] = 1;
  }
  std::vector<std::vector<LiteralItems>> literal(stages.size());
  for (size_t k = 0; k < stages.size(); ++k) {
    const CompactStage& s = stages[k];
    load.result.bytes += s.plan.bytes;
    load.result.descriptors += s.plan.descriptors;
    if (s.plan.descriptors > 0) {
      for (uint32_t l = s.first_layer; l < s.end_layer; ++l) ++load.layer_left[l];
    }
    if (s.moved_from >= 0) {
      KVB_ASSIGN_OR_RETURN(LoadStage st,
                           moved_load_stage(load, s, tensors, literal[static_cast<size_t>(s.moved_from)]));
      load.stages.push_back(std::move(st));
      continue;
    }
    load.stages.push_back(load_stage(load, s, tensors, SIZE_MAX, moved_from[k] ? &literal[k] : nullptr));
    if (moved_from[k]) load.stages.back().list_at.assign(fetched->infos.size(), LoadStage::kNoList);
  }
  // Engine connections to the sources, outside the lock: a connect dials
  // and runs the opening exchange, and must not hold up other loads. The
  // ranks a load would read from hear from it even when it reads nothing
  // of theirs (a request that moves nothing): their holds count every
  // reader.
  KVB_RETURN_IF_ERROR(fetched->sources_error);
  const std::vector<uint32_t>& planned = fetched->sources;
  for (size_t s = 0; s < load.used.size(); ++s) {
    const bool would = std::find(planned.begin(), planned.end(), s) != planned.end();
    if (!load.used[s] && !would) continue;
    Result<PeerId> p = remotes_->peer(remote, s);
    if (!p.ok()) return p.error();
    load.told.push_back(*p);
    if (!load.used[s]) continue;
    load.peers.push_back(*p);
    load.result.sources.push_back(static_cast<uint32_t>(s));
  }
  if (!load.push) {
    KVB_RETURN_IF_ERROR(prepare_lists(load));
  } else {
    // Push: what each source writes, its items and the runs that repeat
    // them, granted in that form (its first layer's places, and each later
    // layer's as a repeat of them: a grant that grows with the blocks, not
    // the layers), and their hash in the same form (write_places(): the
    // "wrote" it sends names the same places, a hash per run). A moved
    // stage's places repeat those of the stage it is moved from.
    for (LoadStage& st : load.stages) st.where.assign(st.items.size(), 0);
    std::vector<size_t> granted_at(load.stages.size());  // per stage, where its places start (items alone)
    for (size_t s = 0, k = 0; s < load.used.size(); ++s) {
      if (!load.used[s]) continue;
      std::vector<WriteGrant> places;
      std::vector<GrantRepeat> repeats;
      // Per stage, its items' sums, for the stages moved from it.
      std::vector<std::optional<PlaceSums>> sums(load.stages.size());
      for (size_t i = 0; i < load.stages.size(); ++i) {
        LoadStage& st = load.stages[i];
        granted_at[i] = SIZE_MAX;
        if (!st.reads(s)) continue;
        if (st.from != LoadStage::kNotMoved) {
          const std::vector<TransferItem>& items = load.stages[st.from].items[s];
          if (!sums[st.from]) sums[st.from].emplace(items, /*items_are_reads=*/true);
          st.where[s] = write_places(items, st.runs[s], /*items_are_reads=*/true, &*sums[st.from]);
          if (granted_at[st.from] == SIZE_MAX) {
            grant_places(items, st.runs[s], &places, &repeats);  // each run's places, moved
            continue;
          }
          for (const ItemRun& r : st.runs[s]) {
            repeats.push_back({granted_at[st.from] + r.first, r.count, r.local, r.local_shift});
          }
          continue;
        }
        const std::vector<TransferItem>& items = st.items[s];
        const std::vector<ItemRun> runs = stage_runs(load, st, s);
        if (!runs.empty()) sums[i].emplace(items, /*items_are_reads=*/true);
        st.where[s] = write_places(items, runs, /*items_are_reads=*/true, sums[i] ? &*sums[i] : nullptr);
        if (runs.empty()) granted_at[i] = places.size();
        grant_places(items, runs, &places, &repeats);
      }
      Result<GrantId> g = engine_.grant_writes(load.peers[k++], places, repeats);
      if (!g.ok()) {
        release_holds(load);
        return g.error().with_context("request " + q(request) + ": granting " + name + " rank " + std::to_string(s) +
                                      " its writes");
      }
      load.grants.push_back(*g);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto queued = queued_.find(request);
  if (queued == queued_.end() || queued->second.gen != gen) {
    release_holds(load);
    return Status();  // aborted meanwhile
  }
  if (loads_.count(request) != 0) {
    release_holds(load);
    return Status::already_exists("request " + q(request) + " is loading");
  }
  ended_.erase(request);
  // A pull load's clock starts when its first read can (after planning);
  // a push load's at start_load(): the sources may be writing already.
  load.called = called;
  load.started = load.push ? called : Clock::now();
  load.deadline = load.started + options_.transfer_timeout;
  load.unsubmitted = load.stages.size();
  if (load.stream) {
    load.announced.assign(layouts.size(), std::vector<uint8_t>(order_.size(), 0));
    load.events.assign(layouts.size(), std::vector<std::string>(order_.size()));
    load.stages_of_layer.resize(order_.size());
    for (uint32_t k = 0; k < load.stages.size(); ++k) {
      const LoadStage& st = load.stages[k];
      for (uint32_t l = st.first_layer; l < st.end_layer && l < order_.size(); ++l)
        load.stages_of_layer[l].push_back(k);
    }
  }
  if (load.push) {
    // A stage with nothing to move has landed; the others land as their
    // sources say "wrote".
    for (LoadStage& st : load.stages) {
      if (written(st)) {
        st.submitted = true;
        --load.unsubmitted;
        land(load, st);
      }
    }
  }
  if (auto early = early_.find(request); early != early_.end()) {
    for (const Early& e : early->second) take(load, e);
    early_count_ -= early->second.size();
    early_.erase(early);
  }
  // The sources hear of the reader before its first read (a heartbeat
  // renews the hold at once, and a source that grants reads by hand-off
  // grants this reader the request's blocks).
  for (PeerId p : load.told) send(p, reader_message(Message::Kind::kHeartbeat, request));
  Status started = start_ready_stages(load);
  load.submit_cpu += thread_cpu_time() - cpu0;
  if (!started.ok()) {
    // An error before the load is under way comes back here, with nothing
    // left in flight; the caller reports the load as failed.
    for (const LoadTransfer& t : load.transfers) {
      (void)engine_.cancel(t.id);
      (void)engine_.release(t.id);
      by_transfer_.erase(t.id);
    }
    release_holds(load);
    return started;
  }
  ++stats_.loads_started;
  queued_.erase(queued);
  auto [it, inserted] = loads_.emplace(request, std::move(load));
  if (it->second.pending == 0 && (it->second.unsubmitted == 0 || !it->second.start_error.ok()) &&
      it->second.told.empty()) {
    end_load(it);  // nothing read, nobody to tell
  } else {
    // The pump ends a load that is over already (push: every stage was
    // written before it started) and tells its sources it is done, or
    // wakes at its deadline.
    poke();
  }
  return Status();
}

// Tells the ranks of `instance` a load of `request` would read from (the
// fewest sources, as plans choose them) that this rank is done with it:
// a load aborted before it started holds no byte of theirs.
void WorkerImpl::release_sources(const std::string& instance, const RequestId& request) {
  Result<Sources> sources = planned_sources(instance);
  if (!sources.ok()) return;
  for (PeerId p : sources->peers) send_done(p, request);
}

// The ranks of `instance` a load of this rank reads from (the fewest, as
// plans choose them), connected: what a load that never started would
// have used. The handshake's or planner's error otherwise.
Result<Sources> WorkerImpl::planned_sources(const std::string& instance) {
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_->fetch(instance));
  KVB_RETURN_IF_ERROR(fetched->sources_error);
  const std::vector<uint32_t>& ranks = fetched->sources;
  Sources out;
  for (uint32_t s : ranks) {
    Result<PeerId> p = remotes_->peer(instance, s);
    if (!p.ok()) {
      if (out.unreachable.ok()) out.unreachable = p.error();
      continue;
    }
    out.engines.insert(fetched->engines[s]);
    out.peers.push_back(*p);
  }
  return out;
}

}  // namespace kvbridge::connector

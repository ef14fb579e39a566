#include "connector/pusher.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "common/text.h"
#include "connector/load.h"
#include "connector/messages.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"

namespace kvbridge::connector {

using Clock = std::chrono::steady_clock;
namespace {
constexpr size_t kEarlyCancelsKept = 65536;
}  // namespace

Pusher::Pusher(Engine& engine, Remotes& remotes, StageCache& stages, const Layout& local, std::vector<RegionId> regions,
               std::vector<std::string> layers, std::vector<uint8_t> device, const WorkerOptions& options,
               std::shared_ptr<SendFailures> failures, std::function<void()> wake)
    : engine_(engine),
      remotes_(remotes),
      stages_(stages),
      local_(local),
      regions_(std::move(regions)),
      layers_(std::move(layers)),
      device_(std::move(device)),
      options_(options),
      failures_(std::move(failures)),
      shared_(std::make_shared<Shared>()) {
  shared_->engine = &engine_;
  shared_->failures = failures_;
  shared_->timeout = options_.transfer_timeout;
  shared_->wake = std::move(wake);
}

Status Pusher::push(RequestId request, const std::string& instance, const Request& blocks, const LoadOptions& options) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pushed_.count(request) != 0) return Status::already_exists("request " + q(request) + " is pushed already");
  }
  if (!remotes_.known(options_.instance_id)) {
    return Status::not_found("push: a prefill rank plans as the decode ranks do, over every rank of its own instance " +
                             q(options_.instance_id) + ": add_remote(" + q(options_.instance_id) +
                             ", the side channels of its ranks) on each of them");
  }
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> own, remotes_.fetch(options_.instance_id));
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> decode, remotes_.fetch(instance));
  const uint32_t me = local_.rank();
  if (me >= own->layouts.size()) {
    return Status::internal("push: this rank (" + std::to_string(me) + ") is not among the " +
                            std::to_string(own->layouts.size()) + " ranks of " + q(options_.instance_id));
  }
  StageOptions so;
  so.layers_per_stage = options.stream ? options_.stream_layers_per_stage : 0;
  so.chunk_tokens = chunk_tokens_of(options.stream, options_.load_chunk_tokens);  // as the decode rank cuts it
  Pushed p;
  p.instance = instance;
  p.stream = options.stream;
  p.ready = options.ready;
  for (uint32_t d = 0; d < decode->layouts.size(); ++d) {
    const Layout& reader = decode->layouts[d];
    // A decode rank that reads nothing from this rank is not planned for
    // (its plan would have no descriptor of ours).
    Result<std::vector<uint32_t>> sources = source_ranks(reader, own->layouts);
    if (!sources.ok()) {
      return sources.error().with_context("request " + q(request) + ": planning " + instance + " rank " +
                                          std::to_string(d));
    }
    if (std::find(sources->begin(), sources->end(), me) == sources->end()) continue;
    // Planned as the decode rank plans it: from the shape's template, from
    // its first load on; streamed, a later layer's stage is the first
    // layer's moved.
    Result<std::vector<CompactStage>> stages =
        stages_.compact_stages(reader, decode, own->layouts, own, blocks, so, nullptr, /*moved=*/options.stream,
                               /*from_first=*/true);
    if (!stages.ok()) {
      return stages.error().with_context("request " + q(request) + ": planning " + instance + " rank " +
                                         std::to_string(d));
    }
    if (options_.verify_plans) {
      Plan all;
      for (size_t k = 0; k < stages->size(); ++k) {
        Plan p = expand(*stages, k);
        all.descriptors.insert(all.descriptors.end(), p.descriptors.begin(), p.descriptors.end());
      }
      Result<VerifyReport> v = verify(all, reader, own->layouts, blocks, /*check_minimal=*/stages->size() == 1);
      if (!v.ok()) {
        return v.error().with_context("request " + q(request) + ": plan to " + instance + " rank " + std::to_string(d) +
                                      " failed verification");
      }
    }
    Target t;
    t.rank = d;
    t.engine = decode->engines[d];
    t.stages = static_cast<uint32_t>(stages->size());
    KVB_RETURN_IF_ERROR(build_target(request, instance, *decode, *own, *stages, &t));
    if (t.mine.empty()) continue;
    p.targets.push_back(std::move(t));
  }
  if (!options.stream && options.ready.empty()) {
    for (const Target& t : p.targets) {
      for (const auto& [k, st] : t.mine) {
        if (!st.device) continue;
        return Status::invalid_argument(
            "request " + q(request) +
            ": its KV is device memory, so push() needs the event recorded after the kernels that wrote it "
            "(LoadOptions::ready: event or event_handle), or host_synchronized once the host waited for them");
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (pushed_.count(request) != 0) return Status::already_exists("request " + q(request) + " is pushed already");
  uint64_t stages = 0;
  for (Target& t : p.targets) {
    auto early = early_cancels_.find({request, t.engine});
    if (early != early_cancels_.end()) {
      t.cancelled = true;  // nothing is written to a rank that cancelled first
      early_cancels_.erase(early);
      continue;
    }
    stages += t.mine.size();
  }
  p.acks->outstanding = stages;
  p.touched = Clock::now();
  auto [it, inserted] = pushed_.emplace(request, std::move(p));
  submit_ready(request, it->second);
  return Status();
}

// This rank's part of each of `stages` (decode rank target->rank's plan) in
// target->mine, and the connection to that rank when there is one.
Status Pusher::build_target(const RequestId& request, const std::string& instance, const Fetched& decode,
                            const Fetched& own, const std::vector<CompactStage>& stages, Target* target) {
  Target& t = *target;
  const uint32_t d = t.rank, me = local_.rank();
  // The plan is the reader's: its local side is the decode rank's, its
  // sources this instance's ranks. This rank's part of each stage is
  // built as the reader builds it (its items and the moved runs that
  // repeat them), then turned around: this rank writes what it reads.
  std::vector<RegionId> reader_regions;
  for (const TensorRegion& x : decode.infos[d].tensors) reader_regions.push_back(x.region);
  // Of the sources, only this rank's part is built: only its regions.
  std::vector<RankInfo> infos(own.infos.size());
  for (RegionId r : regions_) infos[me].tensors.push_back(TensorRegion{{}, r, 0, 0});
  const LoadTensors tensors(reader_regions, decode.layouts[d], infos, own.layouts);
  Load scratch;
  scratch.used.assign(own.layouts.size(), false);
  // A moved stage writes the items of the stage it is moved from, moved:
  // runs of a list of them prepared once per decode rank.
  std::vector<uint8_t> moved_from(stages.size(), 0);
  for (const CompactStage& s : stages) {
    if (s.moved_from >= 0) moved_from[static_cast<size_t>(s.moved_from)] = 1;
  }
  std::vector<std::vector<LiteralItems>> literal(stages.size());
  std::map<uint32_t, std::shared_ptr<const WriteList>> lists;  // by the stage moved from
  std::map<uint32_t, PlaceSums> sums;                          // of a stage's items, by that stage
  bool peered = false;
  for (uint32_t k = 0; k < stages.size(); ++k) {
    const CompactStage& cs = stages[k];
    LoadStage ls;
    if (cs.moved_from >= 0) {
      KVB_ASSIGN_OR_RETURN(ls, moved_load_stage(scratch, cs, tensors, literal[static_cast<size_t>(cs.moved_from)]));
    } else {
      ls = load_stage(scratch, cs, tensors, me, moved_from[k] ? &literal[k] : nullptr);
    }
    if (!ls.reads(me)) continue;
    Stage st;
    st.first_layer = ls.first_layer;
    st.end_layer = ls.end_layer;
    st.device = ls.device[me] != 0;
    if (ls.from != LoadStage::kNotMoved) {
      auto base = t.mine.find(ls.from);
      if (base == t.mine.end()) {
        return Status::internal("request " + q(request) + ": stage " + std::to_string(k) + " to " + instance +
                                " rank " + std::to_string(d) + " is moved from stage " + std::to_string(ls.from) +
                                ", which this rank does not write");
      }
      st.items = base->second.items;
      std::shared_ptr<const WriteList>& list = lists[ls.from];
      if (!list) {
        if (!peered) {
          KVB_ASSIGN_OR_RETURN(t.peer, remotes_.peer(instance, d));
          peered = true;
        }
        Result<PreparedId> id = engine_.prepare(t.peer, TransferOp::kWrite, *st.items);
        if (!id.ok()) {
          return id.error().with_context("request " + q(request) + ": preparing the writes to " + instance + " rank " +
                                         std::to_string(d));
        }
        list = std::make_shared<const WriteList>(&engine_, *id, &lists_held_);
        lists_prepared_.fetch_add(1, std::memory_order_relaxed);
      }
      st.list = list;
    } else {
      std::vector<TransferItem> items = std::move(ls.items[me]);
      for (TransferItem& it : items) {
        std::swap(it.local, it.remote);
        std::swap(it.local_offset, it.remote_offset);
      }
      st.items = std::make_shared<const std::vector<TransferItem>>(std::move(items));
    }
    // The moved runs (a table run as one moved run per move), turned
    // around.
    for (const ItemRun& r : expanded_runs(ls, me, reader_regions, infos[me])) {
      st.runs.push_back({r.first, r.count, r.moved, r.remote, r.remote_shift, r.local, r.local_shift, r.moves});
    }
    // Where it writes, as the decode rank computes it from its own plan:
    // a stage moved from another (or whose runs repeat its own items)
    // hashes those items once, for all the stages over them.
    const PlaceSums* over = nullptr;
    if (!st.runs.empty()) {
      const uint32_t base = ls.from != LoadStage::kNotMoved ? static_cast<uint32_t>(ls.from) : k;
      over = &sums.try_emplace(base, *st.items, /*items_are_reads=*/false).first->second;
    }
    st.where = write_places(*st.items, st.runs, /*items_are_reads=*/false, over);
    t.mine.emplace(k, std::move(st));
  }
  if (!t.mine.empty() && !peered) {
    KVB_ASSIGN_OR_RETURN(t.peer, remotes_.peer(instance, d));
  }
  return Status();
}

std::vector<Pusher::Saved>& Pusher::saved_locked(const RequestId& request) {
  auto& s = saved_[request];
  if (s.first.empty()) s.first.resize(layers_.size());
  s.second = Clock::now();
  return s.first;
}

Status Pusher::save_layer(RequestId request, std::string_view layer, const Readiness& ready) {
  auto o = std::find(layers_.begin(), layers_.end(), layer);
  if (o == layers_.end()) return Status::invalid_argument("no layer " + q(layer) + " in this rank's layout");
  const size_t l = static_cast<size_t>(o - layers_.begin());
  if (device_[l] != 0 && ready.empty()) {
    return Status::invalid_argument("layer " + q(layer) + " of request " + q(request) +
                                    " is device memory: save_layer needs the event recorded after the kernels that "
                                    "wrote it (Readiness::event or event_handle), or host_synchronized once the host "
                                    "waited for them");
  }
  std::lock_guard<std::mutex> lock(mu_);
  Saved& saved = saved_locked(request)[l];
  if (saved.saved) return Status();
  saved = Saved{true, ready};
  auto it = pushed_.find(request);
  if (it != pushed_.end()) {
    it->second.touched = Clock::now();
    submit_ready(request, it->second);
  }
  return Status();
}

Status Pusher::ready_events(const Pushed& p, const Stage& st, const std::vector<Saved>& saved, SubmitOptions* o) const {
  if (!st.device) return Status();  // host memory: the producer wrote it before it said so
  std::vector<const Readiness*> all;
  if (p.stream) {
    for (uint32_t l = st.first_layer; l < st.end_layer; ++l) all.push_back(&saved[l].ready);
  } else {
    all.push_back(&p.ready);
  }
  for (const Readiness* r : all) {
    if (r->host_synchronized) continue;
    if (!r->event_handle.empty() && std::find(o->ready_event_handles.begin(), o->ready_event_handles.end(),
                                              r->event_handle) == o->ready_event_handles.end()) {
      o->ready_event_handles.push_back(r->event_handle);
    }
    if (r->event != 0 && r->event != o->ready_event) {
      if (o->ready_event != 0) {
        return Status::invalid_argument("layers " + layers_[st.first_layer] + ".." + layers_[st.end_layer - 1] +
                                        " of one stage came with different events of this process, and a write "
                                        "waits on one: give them one event, or their IPC handles");
      }
      o->ready_event = r->event;
    }
  }
  if (o->ready_event_handles.size() > kMaxReadyEvents) {
    return Status::invalid_argument("layers " + layers_[st.first_layer] + ".." + layers_[st.end_layer - 1] +
                                    " of one stage came with " + std::to_string(o->ready_event_handles.size()) +
                                    " different event handles, more than " + std::to_string(kMaxReadyEvents) +
                                    ": fewer layers per stage (stream_layers_per_stage), or one event per stage");
  }
  return Status();
}

void Pusher::submit_ready(const RequestId& request, Pushed& p) {
  const std::vector<Saved>& saved = saved_locked(request);
  // The writes started here wake the engine's threads a few times, not
  // once each.
  const SubmitBatch batch(engine_);
  for (Target& t : p.targets) {
    if (t.cancelled) continue;
    for (auto& [k, st] : t.mine) {
      if (st.submitted) continue;
      bool ready = true;
      for (uint32_t l = st.first_layer; p.stream && ready && l < st.end_layer; ++l) ready = saved[l].saved;
      if (!ready) continue;
      st.submitted = true;
      Message m;
      m.kind = Message::Kind::kWrote;
      m.request = request;
      m.stage = k;
      m.stages = t.stages;
      m.where = st.where;
      Write w;
      w.peer = t.peer;
      w.options.timeout = options_.transfer_timeout;
      w.options.verify_content = options_.verify_content;
      w.options.notification = format_message(m);
      m.kind = Message::Kind::kUnwritten;
      w.unwritten = format_message(m);
      w.give_up = Clock::now() + options_.transfer_timeout;
      w.flight = st.flight;
      w.acks = p.acks;
      w.items = std::exchange(st.items, {});
      w.list = st.list ? st.list->id : 0;
      if (w.list != 0) moved_stage_writes_.fetch_add(1, std::memory_order_relaxed);
      if (!st.runs.empty()) {
        w.runs = std::make_shared<const std::vector<ItemRun>>(std::exchange(st.runs, {}));
        writes_as_runs_.fetch_add(1, std::memory_order_relaxed);
      }
      w.what = "request " + q(request) + ": writing to " + p.instance + " rank " + std::to_string(t.rank);
      Status events = ready_events(p, st, saved, &w.options);
      if (!events.ok()) {
        ended(engine_, *p.acks, failures_, t.peer, w.unwritten, options_.transfer_timeout, events.with_context(w.what));
        continue;
      }
      start_write(shared_, std::move(w));
    }
  }
}

Status Pusher::wait_for_save(RequestId request, std::chrono::milliseconds timeout) {
  std::shared_ptr<Acks> acks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pushed_.find(request);
    if (it == pushed_.end()) return Status::not_found("request " + q(request) + " was never pushed");
    acks = it->second.acks;
  }
  Status out;
  {
    std::unique_lock<std::mutex> lock(acks->mu);
    auto settled = [&] { return acks->outstanding == 0; };
    if (timeout.count() <= 0 ? !settled() : !acks->cv.wait_for(lock, timeout, settled)) {  // 0: a poll
      return Status::timeout("request " + q(request) + ": " + std::to_string(acks->outstanding) +
                             " stage writes not ended within " + std::to_string(timeout.count()) +
                             " ms (a streamed stage starts once its layers are saved)");
    }
    out = acks->first_error;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pushed_.erase(request);
  saved_.erase(request);
  return out;
}

void Pusher::cancel(const RequestId& request, const EngineKey& engine) {
  std::vector<TransferId> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pushed_.find(request);
    Target* target = nullptr;
    if (it != pushed_.end()) {
      for (Target& t : it->second.targets) {
        if (t.engine == engine) target = &t;
      }
    }
    if (target == nullptr) {
      // Not pushed yet (or nothing of it goes to that rank): never will be.
      if (it == pushed_.end() && early_cancels_.insert({request, engine}).second) {
        early_order_.emplace_back(request, engine);
        while (early_order_.size() > kEarlyCancelsKept) {
          early_cancels_.erase(early_order_.front());
          early_order_.pop_front();
        }
      }
    } else if (!target->cancelled) {
      target->cancelled = true;
      uint64_t never = 0;
      for (auto& [k, st] : target->mine) {
        if (st.submitted) {
          std::lock_guard<std::mutex> flight_lock(st.flight->mu);
          st.flight->cancelled = true;  // a refused try is not submitted again
          if (st.flight->id != 0) ids.push_back(st.flight->id);
        } else {
          st.submitted = true;
          ++never;
        }
      }
      std::lock_guard<std::mutex> acks_lock(it->second.acks->mu);
      it->second.acks->outstanding -= never;
      it->second.acks->cv.notify_all();
    }
  }
  // When cancel() returns no byte of the write can land at the decode rank
  // (every transport waits for what it sent to be acknowledged).
  for (TransferId id : ids) (void)engine_.cancel(id);
  confirm(request, engine);
}

std::optional<PeerId> Pusher::find_peer(const EngineKey& engine) {
  std::optional<std::pair<std::string, size_t>> where = remotes_.locate(engine);
  if (!where) return std::nullopt;
  Result<PeerId> p = remotes_.peer(where->first, where->second);
  if (!p.ok()) return std::nullopt;
  return *p;
}

void Pusher::confirm(const RequestId& request, const EngineKey& engine) {
  std::optional<PeerId> peer = find_peer(engine);
  if (!peer) {
    std::lock_guard<std::mutex> lock(mu_);
    if (unanswered_.size() < kEarlyCancelsKept) unanswered_.emplace_back(request, engine);
    return;
  }
  engine_.notify(*peer, format_message(Message::Kind::kCancelled, request), options_.transfer_timeout,
                 [failures = failures_](Status s) {
                   if (!s.ok()) failures->add(s);
                 });
}

void Pusher::answer_pending() {
  std::vector<std::pair<RequestId, EngineKey>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(unanswered_);
  }
  for (const auto& [request, engine] : pending) confirm(request, engine);
}

bool Pusher::unanswered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !unanswered_.empty();
}

void Pusher::forget_older_than(Clock::time_point before) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(pushed_, [&](const auto& p) { return p.second.touched < before; });
  std::erase_if(saved_, [&](const auto& s) { return s.second.second < before; });
}

}  // namespace kvbridge::connector

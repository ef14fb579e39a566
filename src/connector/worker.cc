// ConnectorWorker: registration, side channel, loads as engine reads cut
// into stages, layer-wise streaming, and the messages between workers
// (connector.h).
//
// Bookkeeping is under mu_. Loads are engine transfers whose completions
// (SubmitOptions::on_end) land in a small shared inbox (Wakeups), and so do
// the engine's "a notification arrived" signals; one thread of the worker
// ("pump") sleeps on it until a transfer ends, a notification arrives, a
// heartbeat is due or a streamed load's deadline passes. It ends loads,
// starts streamed stages whose layers were announced, and sends heartbeats,
// done messages and announcements without waiting for them (Engine::notify
// with a callback). Nothing polls.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "common/text.h"
#include "common/thread_name.h"
#include "connector/announcer.h"
#include "connector/load.h"
#include "connector/messages.h"
#include "connector/pusher.h"
#include "connector/remotes.h"
#include "connector/side_channel.h"
#include "connector/worker_internal.h"
#include "kvbridge/connector.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"
#include "net/address.h"

namespace kvbridge {
namespace {

using Clock = std::chrono::steady_clock;
using connector::Fetched;
using connector::Load;
using connector::LoadStage;
using connector::LoadTransfer;
constexpr size_t kEndedKept = 4096;   // outcomes kept for wait_for_layer()
constexpr size_t kEarlyKept = 65536;  // announcements (and push's "wrote") kept for loads not started yet
// A push-mode worker's side channel identity: the layout's, and this line;
// its hash the layout's xor this constant ("push"). A pull-mode worker's is
// the layout's alone, so a mismatch names the mode.
constexpr std::string_view kPushIdentityLine = "transfer_mode push\n";
constexpr uint64_t kPushHashXor = 0x7075736800000000ull;
using EngineKey = std::pair<std::string, uint64_t>;

// What a source said about a load (kept when it came before the load
// started): a layer announced (kReady: a = its ordinal), a stage written or
// not (push: a = the stage, b = the stage count).
struct Early {
  EngineKey engine;
  connector::Message::Kind kind;
  uint32_t a = 0, b = 0;
};

// The source ranks of a load: their engines and the connections to them.
struct Sources {
  std::set<EngineKey> engines;
  std::vector<PeerId> peers;
  Status unreachable;  // the first source that could not be connected to (left out)
};

// Push mode: every source of the stage said it wrote its part.
bool written(const LoadStage& st) {
  return std::all_of(st.items.begin(), st.items.end(), [](const auto& v) { return v.empty(); });
}

// What the engine's callbacks push and the pump takes. Shared, so a
// callback that outlives the worker touches nothing else.
struct Wakeups {
  std::mutex mu;
  std::condition_variable cv;
  struct Ended {
    TransferId id;
    Clock::time_point at;
    bool done;
  };
  std::vector<Ended> ended;
  bool notes = false;  // a notification arrived
  // Push mode: a heartbeat to a load's source failed because the source is
  // gone (request, the source's engine name, the error).
  struct Lost {
    RequestId request;
    std::string source;
    Status error;
  };
  std::vector<Lost> lost;
  bool poke = false;  // stop, or look at the loads again (abort)
};

class WorkerImpl final : public ConnectorWorker {
 public:
  WorkerImpl(Engine& engine, Layout layout, const WorkerOptions& options)
      : engine_(engine), layout_(std::move(layout)), options_(options), order_(layer_order(layout_)) {
    for (size_t i = 0; i < order_.size(); ++i) ordinal_.emplace(order_[i], static_cast<uint32_t>(i));
  }

  ~WorkerImpl() override {
    engine_.set_notification_listener(nullptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    jobs_cv_.notify_all();
    connects_cv_.notify_all();
    poke();
    // A handshake under way ends within the handshake timeout.
    if (starter_.joinable()) starter_.join();
    if (connector_.joinable()) connector_.join();
    if (pump_.joinable()) pump_.join();
    // No lock held: a transfer's completion callback may run inside cancel().
    for (auto& [id, load] : loads_) {
      for (const LoadTransfer& t : load.transfers) {
        (void)engine_.cancel(t.id);
        (void)engine_.release(t.id);
      }
    }
    server_.reset();
    for (RegionId r : regions_) (void)engine_.deregister_memory(r);
  }

  Status init(std::span<const std::span<uint8_t>> tensors) {
    KVB_RETURN_IF_ERROR(check_memory(layout_, tensors));
    connector::RankInfo info;
    info.instance_id = options_.instance_id;
    info.rank = layout_.rank();  // pp_rank * tp_size + tp_rank
    info.tp_size = layout_.tp_size * layout_.pp_size;
    info.pid = static_cast<int32_t>(::getpid());
    info.layout_json = to_json(layout_, -1);
    for (size_t t = 0; t < tensors.size(); ++t) {
      KVB_ASSIGN_OR_RETURN(RegionId id, engine_.register_memory(tensors[t].data(), tensors[t].size(),
                                                                layout_.tensors[t].memory, options_.remote_access));
      regions_.push_back(id);
      info.tensors.push_back(connector::TensorRegion{layout_.tensors[t].name, id,
                                                     reinterpret_cast<uint64_t>(tensors[t].data()), tensors[t].size()});
    }
    info.engine_metadata = engine_.metadata();
    connector::SideChannelOptions sc;
    sc.host = options_.side_channel_host;
    sc.advertise_host = options_.side_channel_advertise_host;
    sc.secret = options_.secret;
    sc.timeout = options_.handshake_timeout;
    const bool push = options_.mode == TransferMode::kPush;
    const std::string identity = identity_text(layout_) + std::string(push ? kPushIdentityLine : "");
    const uint64_t hash = compatibility_hash(layout_) ^ (push ? kPushHashXor : 0);
    remotes_ = std::make_unique<connector::Remotes>(engine_, layout_, sc, identity, hash);
    announcer_ = std::make_unique<connector::Announcer>(engine_, *remotes_, order_, options_.transfer_timeout, sent_);
    pusher_ = std::make_unique<connector::Pusher>(engine_, *remotes_, layout_, regions_, order_, options_, sent_);
    KVB_ASSIGN_OR_RETURN(server_, connector::SideChannelServer::start(sc, identity, hash, std::move(info)));
    engine_.set_notification_listener([wake = wake_] {
      {
        std::lock_guard<std::mutex> lock(wake->mu);
        wake->notes = true;
      }
      wake->cv.notify_one();
    });
    pump_ = std::thread([this] {
      set_thread_name("kvb-pump");
      pump();
    });
    starter_ = std::thread([this] {
      set_thread_name("kvb-start");
      // Background work: a caller's wake-up of it must not hand it the
      // caller's CPU (the scheduler would run it first, and start_load()
      // would return only when it sleeps again).
      (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 5);
      start_loop();
    });
    connector_ = std::thread([this] {
      set_thread_name("kvb-connect");
      connect_loop();
    });
    return Status();
  }

  std::string side_channel_address() const override { return server_->address(); }
  const Layout& layout() const override { return layout_; }

  Status add_remote(const std::string& instance, std::vector<std::string> rank_addresses) override {
    return remotes_->add(instance, std::move(rank_addresses));
  }

  Result<std::vector<connector_internal::RemoteRankView>> remote_ranks(const std::string& instance) const {
    std::shared_ptr<const Fetched> f = remotes_->fetched(instance);
    if (!f) return Status::not_found("no handshake with instance '" + instance + "' yet");
    std::vector<connector_internal::RemoteRankView> out;
    for (size_t r = 0; r < f->infos.size(); ++r) {
      connector_internal::RemoteRankView v{f->layouts[r], f->infos[r].pid, {}};
      for (const connector::TensorRegion& t : f->infos[r].tensors) v.tensor_bases.push_back(t.base);
      out.push_back(std::move(v));
    }
    return out;
  }

  Status connect(const std::string& instance) override {
    if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
    if (remotes_->connected(instance)) return Status();
    std::lock_guard<std::mutex> lock(mu_);
    request_connect(instance);
    return Status();
  }

  Status wait_connected(const std::string& instance, std::chrono::milliseconds timeout) override {
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

  Status start_load(RequestId request, const std::string& instance, const Request& blocks,
                    const LoadOptions& options) override {
    KVB_RETURN_IF_ERROR(check_request_id(request));
    if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
    // Planning, submitting and any handshake run on the worker's threads.
    Job job{request, instance, blocks, options, 0, Clock::now()};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (loads_.count(request) != 0 || queued_.count(request) != 0) {
        return Status::already_exists("request " + q(request) + " is loading");
      }
      job.gen = ++queued_gen_;
      queued_[request] = Queued{job.gen, blocks.skip_tokens, instance};
      jobs_.push_back(std::move(job));
    }
    jobs_cv_.notify_one();  // after the lock: the start thread does not wake into it
    return Status();
  }

  // Requires mu_: a connect attempt for `instance` is under way (started
  // now unless one is).
  void request_connect(const std::string& instance) {
    if (!connecting_.insert(instance).second) return;
    connect_errors_.erase(instance);
    connects_.push_back(instance);
    connects_cv_.notify_one();
  }

  // Plans and starts the queued load of generation `gen` (on the start
  // thread, its instance connected), if it is still queued (not aborted).
  Status start_now(const RequestId& request, const std::string& instance, const Request& blocks,
                   const LoadOptions& options, uint64_t gen, Clock::time_point called) {
    KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_->fetch(instance));
    // Planning (and verifying) runs outside the lock, on the immutable snapshot.
    const std::vector<Layout>& layouts = fetched->layouts;
    StageOptions so;
    so.layers_per_stage = options.stream ? options_.stream_layers_per_stage : 0;
    so.chunk_tokens = options_.load_chunk_tokens;
    KVB_ASSIGN_OR_RETURN(std::vector<PlanStage> stages, plan_stages(layout_, layouts, blocks, so));
    if (options_.verify_plans) {
      // The verifier's independent rules on simulated memory: a plan that
      // would move one wrong byte is refused before anything moves. The
      // stages together are the request's plan (minimal when there is one).
      Plan all;
      for (const PlanStage& s : stages) {
        all.descriptors.insert(all.descriptors.end(), s.plan.descriptors.begin(), s.plan.descriptors.end());
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
    load.instance = instance;
    load.fetched = fetched;
    load.stream = options.stream;
    load.push = options_.mode == TransferMode::kPush;
    load.result.request = request;
    load.result.naive_descriptors = naive_descriptor_count(layout_, layouts, blocks);
    load.result.stages = static_cast<uint32_t>(stages.size());
    load.used.assign(layouts.size(), false);
    load.layer_left.assign(order_.size(), 0);
    // Per stage, one batch per source rank, in the plan's (local address) order.
    for (const PlanStage& s : stages) {
      LoadStage ls;
      ls.first_token = s.first_token;
      ls.end_token = s.end_token;
      ls.resume_token = s.resume_token;
      ls.first_layer = s.first_layer;
      ls.end_layer = s.end_layer;
      ls.items.resize(layouts.size());
      load.result.bytes += s.plan.bytes;
      load.result.descriptors += s.plan.descriptors.size();
      for (const Descriptor& d : s.plan.descriptors) {
        ls.items[d.source].push_back(TransferItem{regions_[d.local_tensor], d.local_offset,
                                                  fetched->infos[d.source].tensors[d.remote_tensor].region,
                                                  d.remote_offset, d.bytes});
        load.used[d.source] = true;
      }
      if (!s.plan.descriptors.empty()) {
        for (uint32_t l = s.first_layer; l < s.end_layer; ++l) ++load.layer_left[l];
      }
      load.stages.push_back(std::move(ls));
    }
    // Engine connections to the sources, outside the lock: a connect dials
    // and runs the opening exchange, and must not hold up other loads.
    for (size_t s = 0; s < load.used.size(); ++s) {
      if (!load.used[s]) continue;
      Result<PeerId> p = remotes_->peer(instance, s);
      if (!p.ok()) return p.error();
      load.peers.push_back(*p);
      load.result.sources.push_back(static_cast<uint32_t>(s));
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto queued = queued_.find(request);
    if (queued == queued_.end() || queued->second.gen != gen) return Status();  // aborted meanwhile
    if (loads_.count(request) != 0) return Status::already_exists("request " + q(request) + " is loading");
    ended_.erase(request);
    // A pull load's clock starts when its first read can (after planning);
    // a push load's at start_load(): the sources may be writing already.
    load.started = load.push ? called : Clock::now();
    load.deadline = load.started + options_.transfer_timeout;
    load.unsubmitted = load.stages.size();
    if (load.stream) load.announced.assign(layouts.size(), std::vector<uint8_t>(order_.size(), 0));
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
    if (Status started = start_ready_stages(load); !started.ok()) {
      // An error before the load is under way comes back here, with nothing
      // left in flight; the caller reports the load as failed.
      for (const LoadTransfer& t : load.transfers) {
        (void)engine_.cancel(t.id);
        (void)engine_.release(t.id);
        by_transfer_.erase(t.id);
      }
      return started;
    }
    ++stats_.loads_started;
    queued_.erase(queued);
    auto [it, inserted] = loads_.emplace(request, std::move(load));
    if (it->second.pending == 0 && (it->second.unsubmitted == 0 || !it->second.start_error.ok()) &&
        it->second.peers.empty()) {
      end_load(it);  // nothing read, nobody to tell
    } else {
      // The pump ends a load that is over already (push: every stage was
      // written before it started) and tells its sources it is done, or
      // wakes at its deadline.
      poke();
    }
    return Status();
  }

  Status wait_for_layer(RequestId request, std::string_view layer, std::chrono::milliseconds timeout) override {
    auto o = ordinal_.find(std::string(layer));
    if (o == ordinal_.end()) return Status::invalid_argument("no layer " + q(layer) + " in this rank's layout");
    std::unique_lock<std::mutex> lock(mu_);
    Status out = Status::timeout("request " + q(request) + ": " + q(layer) + " did not land within " +
                                 std::to_string(timeout.count()) + " ms");
    results_cv_.wait_for(lock, timeout, [&] {
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
    });
    return out;
  }

  Status abort(RequestId request) override {
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
          push_instance = load.instance;
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
  Status cancel_sources(const RequestId& request, const std::string& instance, std::optional<Sources> sources) {
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
    for (PeerId p : sources->peers) send(p, connector::format_message(connector::Message::Kind::kCancel, request));
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

  std::vector<LoadResult> take_results() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<LoadResult> out;
    out.swap(results_);
    return out;
  }

  void wait_results(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    results_cv_.wait_for(lock, timeout, [&] { return !results_.empty(); });
  }

  std::vector<ReaderEvent> take_reader_events() override {
    drain_notifications();
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<ReaderEvent> out;
    out.swap(events_);
    return out;
  }

  Status stream_to(RequestId request, const std::string& instance) override {
    KVB_RETURN_IF_ERROR(check_request_id(request));
    if (options_.mode == TransferMode::kPush) {
      return Status::invalid_argument("stream_to() is for pull mode; in push mode push() names the instance");
    }
    return announcer_->stream_to(request, instance);
  }
  Status save_layer(RequestId request, std::string_view layer) override {
    if (options_.mode == TransferMode::kPush) return pusher_->save_layer(request, layer);
    return announcer_->save_layer(request, layer);
  }
  Status wait_for_save(RequestId request, std::chrono::milliseconds timeout) override {
    if (options_.mode == TransferMode::kPush) return pusher_->wait_for_save(request, timeout);
    return announcer_->wait_for_save(request, timeout);
  }
  Status push(RequestId request, const std::string& instance, const Request& blocks,
              const LoadOptions& options) override {
    KVB_RETURN_IF_ERROR(check_request_id(request));
    if (options_.mode != TransferMode::kPush) {
      return Status::invalid_argument("push() needs a worker in push mode (WorkerOptions::mode); this one pulls");
    }
    if (!remotes_->known(instance)) return Status::not_found("unknown remote instance " + q(instance));
    return pusher_->push(std::move(request), instance, blocks, options);
  }

  WorkerStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    WorkerStats s = stats_;
    {
      std::lock_guard<std::mutex> sent_lock(sent_->mu);
      s.notifications_failed = sent_->failed;
      s.last_notification_error = sent_->last_error;
    }
    s.handshakes = remotes_->handshakes();
    s.handshakes_served = server_->served();
    s.handshakes_rejected = server_->rejected();
    s.last_rejection = server_->last_rejection();
    return s;
  }

 private:
  void poke() {
    {
      std::lock_guard<std::mutex> lock(wake_->mu);
      wake_->poke = true;
    }
    wake_->cv.notify_all();
  }

  // Requires mu_: `engine` announced `layer` (an ordinal) of `load`. Taken
  // only from the engine of a source rank of the load's instance.
  void announce(Load& load, const EngineKey& engine, uint32_t layer) {
    for (size_t s = 0; s < load.fetched->engines.size(); ++s) {
      if (load.fetched->engines[s] == engine) load.announced[s][layer] = 1;
    }
  }

  // Requires mu_: a message from `e.engine` about `load`: a layer announced
  // (pull streaming), a stage written or not (push). Taken only from the
  // engine of a source rank of the load's instance.
  void take(Load& load, const Early& e) {
    if (e.kind == connector::Message::Kind::kReady) {
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
    if (e.kind == connector::Message::Kind::kUnwritten) {
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

  // Requires mu_: submits every stage not submitted whose layers every
  // source it reads from announced (all of them, when not streaming). The
  // first submit error stops the load from starting more.
  Status start_ready_stages(Load& load) {
    if (load.aborted || load.expired || !load.start_error.ok()) return load.start_error;
    if (load.push) return Status();  // the sources write
    for (uint32_t k = 0; k < load.stages.size(); ++k) {
      LoadStage& st = load.stages[k];
      if (st.submitted) continue;
      bool ready = true;
      for (size_t s = 0; ready && load.stream && s < st.items.size(); ++s) {
        if (st.items[s].empty()) continue;
        for (uint32_t l = st.first_layer; ready && l < st.end_layer; ++l) ready = load.announced[s][l] != 0;
      }
      if (!ready) continue;
      SubmitOptions o;
      o.timeout = options_.transfer_timeout;
      o.on_end = [wake = wake_](TransferId id, const TransferStatus& ts) {
        {
          std::lock_guard<std::mutex> wl(wake->mu);
          wake->ended.push_back({id, ts.ended_at, ts.state == TransferState::kDone});
        }
        wake->cv.notify_one();
      };
      st.submitted = true;
      st.submitted_at = Clock::now();
      --load.unsubmitted;
      for (size_t s = 0; s < st.items.size(); ++s) {
        if (st.items[s].empty()) continue;
        PeerId peer = load.peers[std::find(load.result.sources.begin(), load.result.sources.end(), s) -
                                 load.result.sources.begin()];
        Result<TransferId> id = engine_.submit(peer, TransferOp::kRead, st.items[s], o);
        if (!id.ok()) {
          st.failed = true;
          load.start_error = id.error().with_context("request " + q(load.request) + ": reading from " + load.instance +
                                                     " rank " + std::to_string(s));
          return load.start_error;
        }
        load.transfers.push_back({static_cast<uint32_t>(s), k, *id});
        by_transfer_[*id] = {load.request, k};
        ++st.pending;
        ++load.pending;
      }
      st.items = {};
      if (st.pending == 0) {
        st.landed_at = st.submitted_at;
        land(load, st);
      }
    }
    return Status();
  }

  // Requires mu_: every transfer of `st` ended done.
  void land(Load& load, LoadStage& st) {
    st.landed = true;
    for (uint32_t l = st.first_layer; l < st.end_layer; ++l) --load.layer_left[l];
    results_cv_.notify_all();
  }

  void drain_notifications() {
    std::vector<Notification> got = engine_.take_notifications();
    if (got.empty()) return;
    std::vector<std::pair<RequestId, EngineKey>> cancels;  // push, prefill side: handled outside the lock
    bool wake_pump = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Notification& n : got) {
        const std::optional<connector::Message> m = connector::parse_message(n.message);
        if (!m) continue;
        using Kind = connector::Message::Kind;
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

  // Never blocks: the engine calls back when the peer acknowledged the
  // message, or at its deadline, or when the peer is gone; a stopped peer
  // delays nothing else.
  // Requires mu_: a heartbeat to the k-th source of a push load. Only the
  // source can write, so one that is gone (the engine says so: kIoError)
  // fails the load at once rather than at its deadline.
  void beat_push_source(const Load& load, size_t k) {
    const std::string source =
        load.fetched->infos[load.result.sources[k]].instance_id + " rank " + std::to_string(load.result.sources[k]);
    engine_.notify(load.peers[k], connector::format_message(connector::Message::Kind::kHeartbeat, load.request),
                   options_.transfer_timeout, [sent = sent_, wake = wake_, request = load.request, source](Status s) {
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

  void send(PeerId peer, const std::string& message) {
    // The callback may outlive the worker (a peer that never answers): it
    // holds only the counters.
    engine_.notify(peer, message, options_.transfer_timeout, [sent = sent_](Status s) {
      if (!s.ok()) sent->add(s);
    });
  }

  // Sleeps until a transfer ends, a notification arrives, a heartbeat is
  // due or a streamed load's deadline passes; ends loads; sends done
  // messages and heartbeats (without waiting for their acknowledgements).
  void pump() {
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
            messages.emplace_back(p, connector::format_message(connector::Message::Kind::kDone, load.request));
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
                messages.emplace_back(load.peers[k],
                                      connector::format_message(connector::Message::Kind::kHeartbeat, id));
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

  // Requires mu_: the load is over (nothing in flight); reports it.
  void end_load(std::map<RequestId, Load>::iterator it) {
    Load& load = it->second;
    finish(load);
    report(std::move(load.result));
    loads_.erase(it);
  }

  // Requires mu_: a queued load that never started ended with `error`
  // (aborted, or its handshake, plan or submit failed); reports it.
  void end_queued(const RequestId& request, uint64_t skip_tokens, Status error, bool aborted) {
    LoadResult r;
    r.request = request;
    r.error = std::move(error);
    r.aborted = aborted;
    r.first_bad_token = skip_tokens;
    ++(aborted ? stats_.loads_aborted : stats_.loads_failed);
    report(std::move(r));
  }

  // Requires mu_: `result` is a load's last word.
  void report(LoadResult result) {
    ended_[result.request] = result.error;
    ended_order_.push_back(result.request);
    if (ended_order_.size() > kEndedKept) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
    results_.push_back(std::move(result));
    results_cv_.notify_all();
  }

  // The start thread: plans and starts the queued loads, in order; one
  // whose instance is not connected waits (parked) for the connect thread.
  void start_loop() {
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

  // Requires mu_: `job` was aborted while queued, and its sources are owed a done message.
  bool abandoned(const RequestId& request, uint64_t gen) const {
    auto a = abandoned_.find(request);
    return a != abandoned_.end() && a->second == gen;
  }

  // Tells the ranks of `instance` a load of `request` would read from (the
  // fewest sources, as plans choose them) that this rank is done with it:
  // a load aborted before it started holds no byte of theirs.
  void release_sources(const std::string& instance, const RequestId& request) {
    Result<Sources> sources = planned_sources(instance);
    if (!sources.ok()) return;
    for (PeerId p : sources->peers) send(p, connector::format_message(connector::Message::Kind::kDone, request));
  }

  // The ranks of `instance` a load of this rank reads from (the fewest, as
  // plans choose them), connected: what a load that never started would
  // have used. The handshake's or planner's error otherwise.
  Result<Sources> planned_sources(const std::string& instance) {
    KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_->fetch(instance));
    KVB_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, source_ranks(layout_, fetched->layouts));
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

  // The connect thread: handshakes with instances and connects to their
  // engines, one at a time; then hands the loads parked on one back to the
  // start thread, or fails them with the attempt's error.
  void connect_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      connects_cv_.wait(lock, [&] { return stop_ || !connects_.empty(); });
      if (stop_) return;
      const std::string instance = std::move(connects_.front());
      connects_.pop_front();
      lock.unlock();
      Status s = connect_now(instance);
      pusher_->answer_pending();  // cancels from ranks of an instance not fetched before
      lock.lock();
      connecting_.erase(instance);
      std::vector<Job> parked = std::move(parked_[instance]);
      parked_.erase(instance);
      for (Job& job : parked) {
        auto qd = queued_.find(job.request);
        if (qd == queued_.end() || qd->second.gen != job.gen) {  // aborted
          if (abandoned(job.request, job.gen)) {
            if (s.ok()) {
              jobs_.push_back(std::move(job));  // the start thread releases its sources
            } else {
              abandoned_.erase(job.request);  // unreachable: the prefill's lease frees its blocks
            }
          }
          continue;
        }
        if (s.ok()) {
          jobs_.push_back(std::move(job));
        } else {
          queued_.erase(qd);
          end_queued(job.request, job.blocks.skip_tokens, s, false);
        }
      }
      if (s.ok()) jobs_cv_.notify_one();
      connect_errors_[instance] = std::move(s);
      results_cv_.notify_all();
    }
  }

  // Handshakes with every rank of `instance` and connects to each engine.
  Status connect_now(const std::string& instance) {
    KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_->fetch(instance));
    for (size_t r = 0; r < fetched->infos.size(); ++r) {
      Result<PeerId> p = remotes_->peer(instance, r);
      if (!p.ok()) return p.error().with_context(instance + " rank " + std::to_string(r) + " engine");
    }
    return Status();
  }

  // Requires mu_: nothing of `load` is in flight.
  void finish(Load& load) {
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

  Engine& engine_;
  const Layout layout_;
  const WorkerOptions options_;
  const std::vector<std::string> order_;     // layer_order(layout_)
  std::map<std::string, uint32_t> ordinal_;  // layer name -> index into order_
  std::vector<RegionId> regions_;
  std::unique_ptr<connector::Remotes> remotes_;
  std::unique_ptr<connector::SideChannelServer> server_;

  mutable std::mutex mu_;
  std::condition_variable results_cv_;                                // results, landed layers, ended loads
  std::map<TransferId, std::pair<RequestId, uint32_t>> by_transfer_;  // -> (request, stage)
  const std::shared_ptr<Wakeups> wake_ = std::make_shared<Wakeups>();
  bool stop_ = false;
  std::map<RequestId, Load> loads_;
  std::map<RequestId, Status> ended_;  // the last kEndedKept outcomes
  std::deque<RequestId> ended_order_;
  std::map<RequestId, std::vector<Early>> early_;
  std::map<RequestId, std::set<EngineKey>> cancelling_;  // push: abort() waits for these sources' "cancelled"
  size_t early_count_ = 0;
  std::deque<RequestId> early_order_;  // requests of early_, first kept first
  // Loads queued for the start thread, and the connect thread's work.
  struct Queued {
    uint64_t gen = 0;  // which start_load (an id may be aborted and loaded again)
    uint64_t skip_tokens = 0;
    std::string instance;
  };
  struct Job {
    RequestId request;
    std::string instance;
    Request blocks;
    LoadOptions options;
    uint64_t gen = 0;
    Clock::time_point called;  // start_load()
  };
  std::map<RequestId, Queued> queued_;
  std::map<RequestId, uint64_t> abandoned_;  // aborted while queued (-> gen): owed a done to its sources
  uint64_t queued_gen_ = 0;
  std::deque<Job> jobs_;  // for the start thread
  std::condition_variable jobs_cv_;
  std::map<std::string, std::vector<Job>> parked_;  // waiting for their instance's connect
  std::deque<std::string> connects_;                // for the connect thread
  std::condition_variable connects_cv_;
  std::set<std::string> connecting_;              // connect() attempts under way
  std::map<std::string, Status> connect_errors_;  // the last attempt's outcome
  std::thread starter_, connector_;
  std::vector<LoadResult> results_;
  std::vector<ReaderEvent> events_;
  WorkerStats stats_;
  const std::shared_ptr<connector::SendFailures> sent_ = std::make_shared<connector::SendFailures>();
  std::unique_ptr<connector::Announcer> announcer_;  // prefill side of streaming
  std::unique_ptr<connector::Pusher> pusher_;        // prefill side of push mode
  std::thread pump_;
};

}  // namespace

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
  auto w = std::make_unique<WorkerImpl>(engine, layout, options);
  KVB_RETURN_IF_ERROR(w->init(tensors));
  return std::unique_ptr<ConnectorWorker>(std::move(w));
}

namespace connector_internal {

Result<std::vector<RemoteRankView>> remote_ranks(const ConnectorWorker& worker, const std::string& instance) {
  const auto* impl = dynamic_cast<const WorkerImpl*>(&worker);
  if (impl == nullptr) return Status::invalid_argument("not a worker made by ConnectorWorker::create");
  return impl->remote_ranks(instance);
}

}  // namespace connector_internal
}  // namespace kvbridge

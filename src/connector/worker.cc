// ConnectorWorker: registration, side channel, remote ranks, loads as engine
// reads, and the heartbeat/done messages between workers (connector.h).
//
// Bookkeeping is under mu_. Loads are engine transfers whose completions
// (SubmitOptions::on_end) land in a small shared inbox (Wakeups); one thread
// of the worker ("pump") sleeps on it until a transfer ends or a heartbeat
// is due, ends loads, and sends heartbeats and done messages without
// waiting for them (Engine::notify with a callback). Nothing polls. Reader
// events are drained from the engine's notifications by take_reader_events.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/thread_name.h"
#include "connector/side_channel.h"
#include "connector/worker_internal.h"
#include "kvbridge/connector.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"

namespace kvbridge {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::string_view kMessagePrefix = "kvb/1 ";

// What the handshakes told us about a remote instance's ranks, in tp_rank
// order; immutable once fetched, so loads plan from it without the lock.
struct Fetched {
  std::vector<connector::RankInfo> infos;
  std::vector<Layout> layouts;
};

struct RemoteInstance {
  std::vector<std::string> addresses;
  std::shared_ptr<const Fetched> fetched;    // null until the first load
  std::vector<std::optional<PeerId>> peers;  // per rank, connected on first use as a source
};

// One read of a load: a chunk's bytes from one source rank.
struct LoadTransfer {
  uint32_t source = 0;  // tp_rank
  uint32_t chunk = 0;   // index into Load::chunks
  TransferId id = 0;
};

struct LoadChunk {
  uint64_t first_token = 0, end_token = 0, resume_token = 0;  // PlanChunk's
};

struct Load {
  RequestId request = 0;
  std::string instance;
  std::vector<LoadChunk> chunks;        // in token order
  std::vector<LoadTransfer> transfers;  // chunk-major, in submission order
  std::vector<PeerId> peers;            // the source ranks read from
  size_t pending = 0;                   // transfers not ended yet
  LoadResult result;
  Clock::time_point started;
  Clock::time_point last_byte{};  // the latest transfer end so far
  bool aborted = false;
};

// Transfer ends, pushed by the engine's completion callbacks (on engine or
// transport threads, or inside submit) and taken by the pump. Shared, so a
// callback that outlives the worker touches nothing else.
struct Wakeups {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<TransferId, Clock::time_point>> ended;  // transfer, when it ended
  bool poke = false;                                            // stop
};

class WorkerImpl final : public ConnectorWorker {
 public:
  WorkerImpl(Engine& engine, Layout layout, const WorkerOptions& options)
      : engine_(engine), layout_(std::move(layout)), options_(options) {}

  ~WorkerImpl() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    {
      std::lock_guard<std::mutex> lock(wake_->mu);
      wake_->poke = true;
    }
    wake_->cv.notify_all();
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
    info.rank = layout_.tp_rank;
    info.tp_size = layout_.tp_size;
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
    sc.secret = options_.secret;
    sc.timeout = options_.handshake_timeout;
    identity_ = identity_text(layout_);
    hash_ = compatibility_hash(layout_);
    KVB_ASSIGN_OR_RETURN(server_, connector::SideChannelServer::start(sc, identity_, hash_, std::move(info)));
    pump_ = std::thread([this] {
      set_thread_name("kvb-pump");
      pump();
    });
    return Status();
  }

  std::string side_channel_address() const override { return server_->address(); }
  const Layout& layout() const override { return layout_; }

  Status add_remote(const std::string& instance, std::vector<std::string> rank_addresses) override {
    if (rank_addresses.empty()) return Status::invalid_argument("instance '" + instance + "' has no rank");
    std::lock_guard<std::mutex> lock(mu_);
    RemoteInstance& r = remotes_[instance];
    if (r.fetched && r.addresses != rank_addresses) {
      return Status::already_exists("instance '" + instance + "' is already known with other addresses");
    }
    r.addresses = std::move(rank_addresses);
    return Status();
  }

  Result<std::vector<connector_internal::RemoteRankView>> remote_ranks(const std::string& instance) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = remotes_.find(instance);
    if (it == remotes_.end() || !it->second.fetched) {
      return Status::not_found("no handshake with instance '" + instance + "' yet");
    }
    const Fetched& f = *it->second.fetched;
    std::vector<connector_internal::RemoteRankView> out;
    for (size_t r = 0; r < f.infos.size(); ++r) {
      connector_internal::RemoteRankView v{f.layouts[r], f.infos[r].pid, {}};
      for (const connector::TensorRegion& t : f.infos[r].tensors) v.tensor_bases.push_back(t.base);
      out.push_back(std::move(v));
    }
    return out;
  }

  Status start_load(RequestId request, const std::string& instance, const Request& blocks) override {
    KVB_RETURN_IF_ERROR(fetch_remote(instance));
    std::unique_lock<std::mutex> lock(mu_);
    if (loads_.count(request) != 0) return Status::already_exists("request " + std::to_string(request) + " is loading");
    const std::shared_ptr<const Fetched> fetched = remotes_[instance].fetched;
    lock.unlock();
    // Planning (and verifying) runs outside the lock, on the immutable snapshot.
    const std::vector<Layout>& layouts = fetched->layouts;
    KVB_ASSIGN_OR_RETURN(std::vector<PlanChunk> chunks,
                         plan_chunks(layout_, layouts, blocks, options_.load_chunk_tokens));
    if (options_.verify_plans) {
      // The verifier's independent rules on simulated memory: a plan that
      // would move one wrong byte is refused before anything moves. The
      // chunks together are the request's plan (minimal when there is one).
      Plan all;
      for (const PlanChunk& c : chunks) {
        all.descriptors.insert(all.descriptors.end(), c.plan.descriptors.begin(), c.plan.descriptors.end());
      }
      Result<VerifyReport> v = verify(all, layout_, layouts, blocks, /*check_minimal=*/chunks.size() == 1);
      std::lock_guard<std::mutex> stats_lock(mu_);
      if (!v.ok()) {
        ++stats_.plans_rejected;
        return v.error().with_context("request " + std::to_string(request) + ": plan from " + instance +
                                      " failed verification");
      }
      ++stats_.plans_verified;
    }
    Load load;
    load.request = request;
    load.instance = instance;
    load.result.request = request;
    load.result.naive_descriptors = naive_descriptor_count(layout_, layouts, blocks);
    // Per chunk, one batch per source rank, in the plan's (local address)
    // order; chunks in token order.
    std::vector<std::vector<std::vector<TransferItem>>> items(chunks.size());
    for (size_t k = 0; k < chunks.size(); ++k) {
      const Plan& p = chunks[k].plan;
      load.chunks.push_back({chunks[k].first_token, chunks[k].end_token, chunks[k].resume_token});
      load.result.bytes += p.bytes;
      load.result.descriptors += p.descriptors.size();
      items[k].resize(layouts.size());
      for (const Descriptor& d : p.descriptors) {
        items[k][d.source].push_back(TransferItem{regions_[d.local_tensor], d.local_offset,
                                                  fetched->infos[d.source].tensors[d.remote_tensor].region,
                                                  d.remote_offset, d.bytes});
      }
    }
    std::vector<bool> used(layouts.size(), false);
    for (const auto& chunk : items) {
      for (size_t s = 0; s < chunk.size(); ++s) used[s] = used[s] || !chunk[s].empty();
    }
    // Engine connections to the sources, outside the lock: a connect dials
    // and runs the opening exchange, and must not hold up other loads.
    for (size_t s = 0; s < used.size(); ++s) {
      if (used[s]) KVB_RETURN_IF_ERROR(connect_peer(instance, s, fetched->infos[s]));
    }
    lock.lock();
    if (loads_.count(request) != 0) return Status::already_exists("request " + std::to_string(request) + " is loading");
    RemoteInstance& remote = remotes_[instance];
    load.started = Clock::now();
    SubmitOptions o;
    o.timeout = options_.transfer_timeout;
    o.on_end = [wake = wake_](TransferId id, const TransferStatus& st) {
      {
        std::lock_guard<std::mutex> wl(wake->mu);
        wake->ended.emplace_back(id, st.ended_at);
      }
      wake->cv.notify_one();
    };
    for (size_t k = 0; k < items.size(); ++k) {
      for (size_t s = 0; s < items[k].size(); ++s) {
        if (items[k][s].empty()) continue;
        Result<TransferId> id = engine_.submit(*remote.peers[s], TransferOp::kRead, items[k][s], o);
        if (!id.ok()) {
          for (const LoadTransfer& t : load.transfers) {
            (void)engine_.cancel(t.id);
            (void)engine_.release(t.id);
            by_transfer_.erase(t.id);
          }
          return id.error().with_context("request " + std::to_string(request) + ": reading from " + instance +
                                         " rank " + std::to_string(s));
        }
        load.transfers.push_back({static_cast<uint32_t>(s), static_cast<uint32_t>(k), *id});
        by_transfer_[*id] = request;
      }
    }
    for (size_t s = 0; s < used.size(); ++s) {
      if (!used[s]) continue;
      load.peers.push_back(*remote.peers[s]);
      load.result.sources.push_back(static_cast<uint32_t>(s));
    }
    load.pending = load.transfers.size();
    ++stats_.loads_started;
    if (load.pending == 0) {
      // Nothing to move (the rank already holds every token): done now.
      load.last_byte = load.started;
      finish(load);
      results_.push_back(std::move(load.result));
      results_cv_.notify_all();
      return Status();
    }
    loads_.emplace(request, std::move(load));
    return Status();
  }

  Status abort(RequestId request) override {
    std::vector<TransferId> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = loads_.find(request);
      if (it == loads_.end()) return Status::not_found("request " + std::to_string(request) + " is not loading");
      it->second.aborted = true;
      for (const LoadTransfer& t : it->second.transfers) ids.push_back(t.id);
    }
    // cancel() returns once no byte of the transfer can land any more.
    for (TransferId t : ids) KVB_RETURN_IF_ERROR(engine_.cancel(t));
    return Status();
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

  WorkerStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    WorkerStats s = stats_;
    {
      std::lock_guard<std::mutex> sent_lock(sent_->mu);
      s.notifications_failed = sent_->failed;
      s.last_notification_error = sent_->last_error;
    }
    s.handshakes_served = server_->served();
    s.handshakes_rejected = server_->rejected();
    s.last_rejection = server_->last_rejection();
    return s;
  }

 private:
  // Fetches every rank of `instance` once (the handshake), outside mu_.
  Status fetch_remote(const std::string& instance) {
    std::vector<std::string> addresses;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = remotes_.find(instance);
      if (it == remotes_.end()) return Status::not_found("unknown remote instance '" + instance + "'");
      if (it->second.fetched) return Status();
      addresses = it->second.addresses;
    }
    std::lock_guard<std::mutex> fetch(fetch_mu_);  // one handshake round per instance at a time
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (remotes_[instance].fetched) return Status();
    }
    connector::SideChannelOptions sc;
    sc.secret = options_.secret;
    sc.timeout = options_.handshake_timeout;
    auto fetched = std::make_shared<Fetched>();
    for (size_t r = 0; r < addresses.size(); ++r) {
      const std::string who = instance + " rank " + std::to_string(r);
      Result<connector::RankInfo> got = connector::fetch_rank_info(addresses[r], identity_, hash_, sc);
      if (!got.ok()) return got.error().with_context(who);
      connector::RankInfo info = std::move(*got);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.handshakes;
      }
      Result<Layout> parsed = parse_layout(info.layout_json);
      if (!parsed.ok()) return parsed.error().with_context(who + " layout");
      Layout l = std::move(*parsed);
      KVB_RETURN_IF_ERROR(check_compatible(layout_, l).with_context(instance + " rank " + std::to_string(r)));
      if (l.tp_rank != r || l.tp_size != addresses.size() || info.tensors.size() != l.tensors.size()) {
        return Status::incompatible(instance + " rank " + std::to_string(r) + " at " + addresses[r] +
                                    " describes itself as rank " + std::to_string(l.tp_rank) + " of " +
                                    std::to_string(l.tp_size) + " with " + std::to_string(info.tensors.size()) +
                                    " tensor regions");
      }
      fetched->infos.push_back(std::move(info));
      fetched->layouts.push_back(std::move(l));
    }
    std::lock_guard<std::mutex> lock(mu_);
    RemoteInstance& r = remotes_[instance];
    r.peers.assign(fetched->infos.size(), std::nullopt);
    r.fetched = std::move(fetched);
    return Status();
  }

  // Connects the engine to source rank `rank` of `instance` once (without
  // mu_: it dials and waits for the peer's answer).
  Status connect_peer(const std::string& instance, size_t rank, const connector::RankInfo& info) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (remotes_[instance].peers[rank]) return Status();
    }
    KVB_ASSIGN_OR_RETURN(PeerId id, engine_.connect(info.engine_metadata));
    std::lock_guard<std::mutex> lock(mu_);
    remotes_[instance].peers[rank] = id;
    return Status();
  }

  void drain_notifications() {
    std::vector<Notification> got = engine_.take_notifications();
    if (got.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (Notification& n : got) {
      std::string_view m = n.message;
      if (m.substr(0, kMessagePrefix.size()) != kMessagePrefix) continue;
      m.remove_prefix(kMessagePrefix.size());
      ReaderEvent e;
      if (m.substr(0, 3) == "hb ") {
        e.kind = ReaderEvent::Kind::kHeartbeat;
        m.remove_prefix(3);
      } else if (m.substr(0, 5) == "done ") {
        e.kind = ReaderEvent::Kind::kDone;
        m.remove_prefix(5);
      } else {
        continue;
      }
      uint64_t id = 0;
      const auto [end, ec] = std::from_chars(m.data(), m.data() + m.size(), id);
      if (m.empty() || ec != std::errc() || end != m.data() + m.size()) continue;
      e.request = id;
      e.reader = std::move(n.peer);
      events_.push_back(std::move(e));
    }
  }

  // Never blocks: the engine calls back when the peer acknowledged the
  // message, or at its deadline, or when the peer is gone; a stopped peer
  // delays nothing else.
  void send(PeerId peer, const std::string& message) {
    // The callback may outlive the worker (a peer that never answers): it
    // holds only the counters.
    engine_.notify(peer, message, options_.transfer_timeout, [sent = sent_](Status s) {
      if (s.ok()) return;
      std::lock_guard<std::mutex> lock(sent->mu);
      ++sent->failed;
      sent->last_error = s.to_string();
    });
  }

  // Sleeps until a transfer ends or a heartbeat is due; ends loads whose
  // transfers all ended; sends done messages and heartbeats (without
  // waiting for their acknowledgements).
  void pump() {
    Clock::time_point next_beat = Clock::now() + options_.heartbeat_interval;
    while (true) {
      std::vector<std::pair<TransferId, Clock::time_point>> ended;
      {
        std::unique_lock<std::mutex> wl(wake_->mu);
        wake_->cv.wait_until(wl, next_beat, [&] { return !wake_->ended.empty() || wake_->poke; });
        ended.swap(wake_->ended);
      }
      std::vector<std::pair<PeerId, std::string>> messages;
      bool any_result = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        for (const auto& [transfer, at] : ended) {
          auto t = by_transfer_.find(transfer);
          if (t == by_transfer_.end()) continue;  // a load that failed to start
          auto it = loads_.find(t->second);
          by_transfer_.erase(t);
          if (it == loads_.end()) continue;
          Load& load = it->second;
          load.last_byte = std::max(load.last_byte, at);
          if (--load.pending > 0) continue;
          finish(load);
          for (PeerId p : load.peers) {
            messages.emplace_back(p, std::string(kMessagePrefix) + "done " + std::to_string(load.request));
          }
          results_.push_back(std::move(load.result));
          loads_.erase(it);
          any_result = true;
        }
        if (Clock::now() >= next_beat) {
          next_beat = Clock::now() + options_.heartbeat_interval;
          for (auto& [id, load] : loads_) {
            for (PeerId p : load.peers)
              messages.emplace_back(p, std::string(kMessagePrefix) + "hb " + std::to_string(id));
          }
        }
      }
      if (any_result) results_cv_.notify_all();
      for (auto& [peer, m] : messages) send(peer, m);
    }
  }

  // Requires mu_: every transfer of `load` ended. The first error in
  // submission order (token order, then source) wins; the first bad token
  // is where the earliest chunk that did not arrive whole resumes.
  void finish(Load& load) {
    const Clock::time_point now = Clock::now();
    load.result.transfer_time = std::chrono::duration_cast<std::chrono::microseconds>(load.last_byte - load.started);
    load.result.completion_lag = std::chrono::duration_cast<std::chrono::microseconds>(now - load.last_byte);
    load.result.aborted = load.aborted;
    uint64_t first_bad = load.chunks.back().end_token;
    for (const LoadTransfer& t : load.transfers) {
      TransferStatus st = engine_.status(t.id);
      (void)engine_.release(t.id);
      if (st.state == TransferState::kDone) continue;
      const LoadChunk& c = load.chunks[t.chunk];
      first_bad = std::min(first_bad, c.resume_token);
      if (!load.result.error.ok()) continue;
      load.result.error = st.error.ok()
                              ? Status::internal("transfer ended as " + std::string(transfer_state_name(st.state)))
                              : st.error;
      std::string what = "request " + std::to_string(load.request) + ": reading from " + load.instance + " rank " +
                         std::to_string(t.source) + " (";
      if (load.chunks.size() > 1) {
        what += "tokens " + std::to_string(c.first_token) + ".." + std::to_string(c.end_token) + ", chunk " +
                std::to_string(t.chunk + 1) + " of " + std::to_string(load.chunks.size()) + ": ";
      }
      load.result.error = load.result.error.with_context(what + std::to_string(st.bytes_done) + " of " +
                                                         std::to_string(st.bytes_total) + " bytes)");
    }
    if (load.aborted && load.result.error.ok()) {
      load.result.error = Status::cancelled("request " + std::to_string(load.request) + " was aborted");
    }
    if (load.aborted) first_bad = load.chunks.front().resume_token;
    load.result.first_bad_token = load.result.error.ok() ? 0 : first_bad;
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
  std::string identity_;
  uint64_t hash_ = 0;
  std::vector<RegionId> regions_;
  std::unique_ptr<connector::SideChannelServer> server_;

  mutable std::mutex mu_;
  std::mutex fetch_mu_;
  std::condition_variable results_cv_;
  std::map<TransferId, RequestId> by_transfer_;  // transfers of loads in progress
  const std::shared_ptr<Wakeups> wake_ = std::make_shared<Wakeups>();
  bool stop_ = false;
  std::map<std::string, RemoteInstance> remotes_;
  std::map<RequestId, Load> loads_;
  std::vector<LoadResult> results_;
  std::vector<ReaderEvent> events_;
  WorkerStats stats_;
  struct Sent {
    std::mutex mu;
    uint64_t failed = 0;
    std::string last_error;
  };
  std::shared_ptr<Sent> sent_ = std::make_shared<Sent>();
  std::thread pump_;
};

}  // namespace

Result<std::unique_ptr<ConnectorWorker>> ConnectorWorker::create(Engine& engine, const Layout& layout,
                                                                 std::span<const std::span<uint8_t>> tensors,
                                                                 const WorkerOptions& options) {
  KVB_RETURN_IF_ERROR(validate(layout).with_context("worker layout"));
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

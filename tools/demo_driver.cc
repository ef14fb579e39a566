// The driver of `kvbridge demo` (demo.h): forks the ranks (demo_ranks.h), plays both
// instances' schedulers and block allocators, runs the requests one after the
// other (each decode rank of the target instance loads in parallel), injects
// the chosen fault, and collects what the report needs.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <functional>
#include <random>
#include <set>
#include <thread>

#include "demo_blocks.h"
#include "demo_driver.h"
#include "demo_flood.h"
#include "demo_ranks.h"
#include "kvbridge/presets.h"

namespace kvbridge::cli::demo {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using namespace std::chrono_literals;

// What is in flight for the current request.
struct Current {
  RequestId id;
  std::vector<json> replies;  // prefilled / raw / freed / aborted / recomputed replies
};

class Driver {
 public:
  explicit Driver(const DemoArgs& a) : a_(a), rng_(a.seed) { sum_.args = &a_; }

  Status run() {
    KVB_RETURN_IF_ERROR(check_args());
    const auto t0 = Clock::now();
    KVB_RETURN_IF_ERROR(spawn());
    KVB_RETURN_IF_ERROR(wait_ready());
    KVB_RETURN_IF_ERROR(start_hostiles());
    for (uint32_t i = 0; i < a_.requests; ++i) {
      if (flooding_ && i == a_.requests / 2) stop_flood();
      KVB_RETURN_IF_ERROR(one_request(i));
      if (a_.progress) print_progress(i + 1, a_.requests);
    }
    if (flooding_) stop_flood();
    if (pauser_.pid > 0) {
      demo::stop(pauser_);
      sum_.pauses = 1;  // counted for the report: the rank was paused throughout
    }
    drain_leases();
    finish();
    sum_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    sum_.leaked_blocks = ppool_->in_use() + psched_.held();
    sum_.double_frees = ppool_->double_frees();
    for (const InstancePools& p : dpools_) {
      sum_.leaked_blocks += p.in_use();
      sum_.double_frees += p.double_frees();
    }
    return Status();
  }

  ~Driver() {
    if (flooding_) stop_flood();
    demo::stop(pauser_);
  }

  const Summary& summary() const { return sum_; }

 private:
  Status check_args() {
    KVB_ASSIGN_OR_RETURN(FailurePolicy policy, parse_failure_policy(a_.policy));
    if (a_.requests == 0) return Status::invalid_argument("--requests must be at least 1");
    if (a_.transport != "cma" && a_.transport != "tcp" && a_.transport != "ucx" && a_.transport != "cuda_ipc") {
      return Status::invalid_argument("--transport '" + a_.transport +
                                      "': the demo's ranks are processes; use cma, tcp or ucx (cuda_ipc with "
                                      "--memory cuda)");
    }
    // --memory cuda: the driver never touches the device before the ranks
    // fork (a process that initialised CUDA cannot use it in a forked
    // child); a rank without a device fails its start, saying why.
    if (a_.decode_instances == 0) return Status::invalid_argument("--decode-instances must be at least 1");
    KVB_ASSIGN_OR_RETURN(PoolSizes sizes, size_pools(a_));
    max_tokens_ = sizes.max_tokens;
    sum_.num_blocks = sizes.num_blocks;
    sum_.state_blocks = sizes.state_blocks;
    player_ = std::move(sizes.prefill);
    dlayout_ = std::move(sizes.decode);
    pstate_groups_ = state_pool_groups(player_);
    dstate_groups_ = state_pool_groups(dlayout_);
    ppool_.emplace(sum_.num_blocks, sum_.state_blocks);
    for (uint32_t i = 0; i < a_.decode_instances; ++i) {
      dpools_.emplace_back(sum_.num_blocks, sum_.state_blocks);
      dscheds_.emplace_back(a_.decode.ranks(), policy);
    }
    psched_ = PrefillScheduler(a_.lease);
    return Status();
  }

  // Forks every rank before any thread exists in this process.
  Status spawn() { return ranks_.spawn(a_, sum_.num_blocks, sum_.state_blocks); }

  Status wait_ready() {
    const auto deadline = Clock::now() + 120s;
    while (std::any_of(ranks_.all().begin(), ranks_.all().end(), [](auto& p) { return p->alive && !p->ready; })) {
      if (Clock::now() > deadline) return Status::timeout("ranks did not start within 120 s");
      pump(5ms);
      for (auto& p : ranks_.all()) {
        if (!p->alive && !p->ready) {
          std::string why;
          for (const std::string& e : sum_.rank_errors) why += (why.empty() ? "" : "; ") + e;
          return Status::unavailable(p->instance + " rank " + std::to_string(p->rank) + " could not start: " + why);
        }
      }
    }
    return ranks_.connect(a_);
  }

  // Reads every rank's messages for up to `wait`, dispatches them, and
  // frees what the schedulers release.
  void pump(std::chrono::milliseconds wait) {
    // One time for the round: when the poll returned.
    std::optional<Clock::time_point> read;
    auto at_read = [&read] { return read ? *read : *(read = Clock::now()); };
    ranks_.poll(
        wait, [&](Proc& p, json& m) { dispatch(p, m, at_read()); }, [this](Proc& p) { lost(p); });
    const auto now = at_read();
    for (const Release& r : psched_.take_releases(now)) {
      ++sum_.releases[std::string(release_reason_name(r.reason))];
      auto it = prefill_blocks_.find(r.request);
      if (it != prefill_blocks_.end()) {
        // The prefill ranks hear it before the blocks go to another request.
        for (Proc* p : ranks_of(true, 0)) {
          if (p->alive) (void)p->ch.send({{"cmd", "released"}, {"req", r.request}, {"readers", r.readers_done}});
        }
        it->second.release_to(*ppool_);
        prefill_blocks_.erase(it);
      }
    }
    for (uint32_t i = 0; i < dscheds_.size(); ++i) {
      for (RequestOutcome& o : dscheds_[i].take_outcomes(now)) outcomes_.push_back(std::move(o));
    }
  }

  void lost(Proc& p) {
    p.alive = false;
    int status = 0;
    ::waitpid(p.pid, &status, 0);
    p.ch.close();
    const std::string how = WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                                : "exited with status " + std::to_string(WEXITSTATUS(status));
    const std::string name = p.engine.empty() ? p.instance + "/r" + std::to_string(p.rank) : p.engine;
    if (!p.killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0 && p.final)) {
      sum_.rank_errors.push_back(name + " " + how);
    }
    if (!p.prefill) dscheds_[p.decode_instance].rank_lost(p.rank, Status::io_error(name + " " + how));
  }

  void dispatch(Proc& p, json& m, Clock::time_point now) {
    const std::string ev = m.value("ev", "");
    const RequestId id = m.value("req", RequestId());
    if (ev == "ready") {
      p.ready = true;
      p.side_channel = m.value("side_channel", "");
      p.engine = m.value("engine", "");
      p.listeners = m.value("listeners", std::vector<std::string>{});
    } else if (ev == "reader") {
      if (m.value("kind", "") == "done") {
        psched_.reader_done(id, m.value("reader", ""), now);
      } else {
        psched_.heartbeat(id, m.value("reader", ""), now);
      }
    } else if (ev == "loaded") {
      loaded_at_[id] = std::max(loaded_at_[id], at(m, now));
      LoadResult r;
      r.request = id;
      r.aborted = m.value("aborted", false);
      if (!m.value("ok", false)) r.error = Status::io_error(m.value("error", ""));
      r.first_bad_token = m.value("first_bad_token", uint64_t{0});
      loads_[id].push_back(m);
      (void)dscheds_[p.decode_instance].rank_result(p.rank, r);  // not waiting: aborted already
    } else if (ev == "pushed") {
      // A prefill rank's writes of a request ended; the decode ranks'
      // results say whether they landed.
    } else if (ev == "discovered") {
      ++sum_.discovered;
      sum_.discovery_ms_max = std::max(sum_.discovery_ms_max, m.value("ms", 0.0));
    } else if (ev == "final") {
      p.final = m;
    } else if (ev == "fatal" || ev == "error") {
      sum_.rank_errors.push_back((p.engine.empty() ? p.instance + "/r" + std::to_string(p.rank) : p.engine) + ": " +
                                 m.value("error", ""));
    } else if (id == current_.id) {
      if (ev == "prefilled") {
        prefilled_at_ = std::max(prefilled_at_, at(m, now));
        ++prefilled_;
        sum_.prefill_layers += m.value("layers", uint64_t{0});
        sum_.prefill_layers_over_budget += m.value("over_budget", uint64_t{0});
      }
      current_.replies.push_back(m);
    }
  }

  // The rank's own time of an event ("at_ns", steady_clock: one clock for
  // the host's processes), or when the driver read it.
  static Clock::time_point at(const json& m, Clock::time_point read) {
    if (!m.contains("at_ns")) return read;
    return Clock::time_point(
        std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(m["at_ns"].get<int64_t>())));
  }

  std::vector<Proc*> ranks_of(bool prefill, uint32_t inst) const { return ranks_.of(prefill, inst); }

  // Sends `cmd` to `ranks` and waits for one reply from each still alive.
  Status round(const std::vector<Proc*>& ranks, const json& cmd, std::chrono::milliseconds timeout) {
    current_.replies.clear();
    for (Proc* p : ranks) (void)p->ch.send(cmd);
    const auto deadline = Clock::now() + timeout;
    auto alive = [&] { return std::count_if(ranks.begin(), ranks.end(), [](Proc* p) { return p->alive; }); };
    while (current_.replies.size() < static_cast<size_t>(alive())) {
      if (Clock::now() > deadline) {
        return Status::timeout("no '" + cmd.value("cmd", "") + "' reply within " + std::to_string(timeout.count()) +
                               " ms");
      }
      pump(2ms);
    }
    return Status();
  }

  Result<Request> make_request(RequestRecord& rec) {
    Request q;
    q.num_tokens = rec.tokens;
    q.skip_tokens = rec.skip;
    HeldBlocks pheld, dheld;
    for (const Group& g : dlayout_.groups) {
      if (!g.transfer) continue;
      const Group* pg = player_.find_group(g.name);
      const bool pstate = pstate_groups_.contains(pg->name), dstate = dstate_groups_.contains(g.name);
      const uint64_t pn = blocks_for(*pg, rec.tokens), dn = blocks_for(g, rec.tokens);
      BlockPool& ppool = ppool_->of(pstate);
      BlockPool& dpool = dpools_[rec.decode_instance].of(dstate);
      std::optional<std::vector<int64_t>> p, d;
      for (auto until = Clock::now() + a_.lease + 2s;;) {
        p = ppool.allocate(pn, rng_);
        if (p) d = dpool.allocate(dn, rng_);
        if (p && d) break;
        if (p) ppool.release(*p);
        if (Clock::now() > until) return Status::resource_exhausted("no free blocks for request " + rec.id);
        pump(5ms);  // blocks come back as leases end
      }
      pheld.of(pstate).insert(pheld.of(pstate).end(), p->begin(), p->end());
      dheld.of(dstate).insert(dheld.of(dstate).end(), d->begin(), d->end());
      q.blocks[g.name] = {*d, *p};
    }
    prefill_blocks_[rec.id] = std::move(pheld);
    decode_blocks_ = std::move(dheld);
    return q;
  }

  uint32_t fault_index() const {
    const bool last = a_.inject == Inject::kKillPrefill || a_.inject == Inject::kKillDecode;
    return last ? a_.requests - 1 : a_.requests / 2;
  }

  // One request; with --stream on and no fault in it, the same request
  // again, not streamed, as the baseline.
  Status one_request(uint32_t i) {
    RequestRecord rec;
    rec.n = 1000 + i;
    rec.id = "req-" + std::to_string(rec.n);
    rec.decode_instance = i % a_.decode_instances;
    rec.tokens = a_.min_tokens + rng_() % (max_tokens_ - a_.min_tokens + 1);
    rec.skip = i % 3 == 1 ? rng_() % rec.tokens : 0;  // a prefix hit on the decode side
    const bool fault = a_.inject != Inject::kNone && i == fault_index();
    const uint64_t min_tokens = a_.stream_min_tokens ? a_.stream_min_tokens : kAutoStreamTokens;
    rec.streamed = a_.stream == "layer" || (a_.stream == "auto" && rec.tokens >= min_tokens);
    if (fault && a_.inject == Inject::kLease) rec.streamed = false;  // nobody reads
    RequestRecord base = rec;
    KVB_RETURN_IF_ERROR(run_request(rec, fault));
    sum_.requests.push_back(rec);
    if (a_.stream == "off" || a_.inject != Inject::kNone) return Status();  // a fault run has no baseline
    base.n = 1000 + a_.requests + i;
    base.id = "req-" + std::to_string(base.n);
    base.streamed = false;
    KVB_RETURN_IF_ERROR(run_request(base, false));
    sum_.baselines.push_back(base);
    return Status();
  }

  Status run_request(RequestRecord& rec, bool fault) {
    KVB_ASSIGN_OR_RETURN(Request q, make_request(rec));
    current_.id = rec.id;
    const std::string qjson = to_json(q, -1);
    const uint64_t seed = a_.seed * 1000003 + rec.n;
    const std::vector<Proc*> prefill = ranks_of(true, 0), decode = ranks_of(false, rec.decode_instance);
    const json prefill_cmd = {
        {"cmd", "prefill"}, {"req", rec.id},          {"request", json::parse(qjson)},
        {"seed", seed},     {"stream", rec.streamed}, {"to", "decode-" + std::to_string(rec.decode_instance)}};
    std::set<std::string> readers;
    for (Proc* p : decode) readers.insert(p->engine);
    // The prefill's blocks resident, as an engine's KV memory is (the
    // ranks' memory is mapped lazily): page faults are not prefill compute.
    KVB_RETURN_IF_ERROR(round(prefill, {{"cmd", "resident"}, {"req", rec.id}, {"request", json::parse(qjson)}}, 60s));
    const Clock::time_point admitted = Clock::now();
    prefilled_at_ = {};
    prefilled_ = 0;
    loaded_at_.erase(rec.id);
    if (rec.streamed) {
      // Admitted at both instances at once: the decode ranks start their
      // loads while the prefill computes; each layer moves once announced.
      KVB_RETURN_IF_ERROR(psched_.hold(rec.id, readers, admitted));
      current_.replies.clear();
      for (Proc* p : prefill) (void)p->ch.send(prefill_cmd);
    } else {
      KVB_RETURN_IF_ERROR(round(prefill, prefill_cmd, 60s));
      KVB_RETURN_IF_ERROR(psched_.hold(rec.id, readers, Clock::now()));
    }
    if (fault && a_.inject == Inject::kLease) {
      // Nobody reads: the lease alone must free the blocks.
      while (prefill_blocks_.count(rec.id) != 0) pump(5ms);
      rec.outcome = "lease_expired";
      rec.error = "lease of " + std::to_string(a_.lease.count()) + " ms expired with no reader";
      return end_request(rec, decode);
    }
    DecodeScheduler& ds = dscheds_[rec.decode_instance];
    KVB_RETURN_IF_ERROR(ds.expect(rec.id, rec.skip, Clock::now() + a_.transfer_timeout + 10s));
    loads_.erase(rec.id);
    for (Proc* p : decode) {
      (void)p->ch.send({{"cmd", "load"},
                        {"req", rec.id},
                        {"instance", "prefill"},
                        {"request", json::parse(qjson)},
                        {"seed", seed},
                        {"stream", rec.streamed}});
    }
    if (a_.mode == "push" && !rec.streamed) {
      // The KV is computed and the decode ranks are loading: the prefill
      // ranks write it (a streamed request was pushed layer by layer).
      for (Proc* p : prefill) {
        (void)p->ch.send({{"cmd", "push"}, {"req", rec.id}, {"to", "decode-" + std::to_string(rec.decode_instance)}});
      }
    }
    if (fault) inject(rec, decode);
    std::optional<RequestOutcome> out;
    while (!out) {
      pump(2ms);
      for (auto it = outcomes_.begin(); it != outcomes_.end(); ++it) {
        if (it->request == rec.id) {
          out = *it;
          outcomes_.erase(it);
          break;
        }
      }
    }
    rec.outcome = std::string(outcome_name(out->outcome));
    if (!out->error.ok()) rec.error = out->error.message();
    if (rec.streamed) {
      // The prefill's forward pass may still be announcing: its reply ends it.
      const auto until = Clock::now() + 60s;
      const size_t errors = sum_.rank_errors.size();
      while (prefilled_ < prefill.size() && Clock::now() < until && sum_.rank_errors.size() == errors &&
             std::all_of(prefill.begin(), prefill.end(), [](Proc* p) { return p->alive; })) {
        pump(2ms);
      }
    }
    auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
    if (out->outcome == Outcome::kFinished && loaded_at_.count(rec.id) && prefilled_at_ != Clock::time_point{}) {
      rec.ttft_ms = ms(loaded_at_[rec.id] - admitted);
      rec.exposed_ms = std::max(0.0, ms(loaded_at_[rec.id] - prefilled_at_));
    }
    for (const json& l : loads_[rec.id]) {
      rec.bytes += l.value("bytes", uint64_t{0});
      rec.descriptors += l.value("descriptors", uint64_t{0});
      rec.naive += l.value("naive", uint64_t{0});
      rec.transfer_us = std::max(rec.transfer_us, l.value("transfer_us", uint64_t{0}));
      rec.last_stage_ms = std::max(rec.last_stage_ms, l.value("last_stage_us", 0.0) / 1000.0);
      rec.start_ns = std::max(rec.start_ns, l.value("start_ns", uint64_t{0}));
      rec.completion_lag_us = std::max(rec.completion_lag_us, l.value("completion_lag_us", uint64_t{0}));
    }
    // Every byte of every load that ended well, checked now that no rank's
    // transfer of the request runs any more.
    json check = {{"cmd", "check"}, {"req", rec.id}};
    if (fault && a_.inject == Inject::kCorrupt) check["corrupt"] = decode.front()->engine;
    KVB_RETURN_IF_ERROR(round(decode, check, 60s));
    for (const json& r : current_.replies) {
      rec.verify_bad += r.value("verify_bad", uint64_t{0});
      if (rec.verify_error.empty()) rec.verify_error = r.value("verify_error", "");
    }
    if (out->outcome == Outcome::kFinished) {
      // The kernel's copy in the direction the library copied: the decode
      // ranks read (pull), or the prefill ranks write (push).
      const bool push = a_.mode == "push";
      const std::string other = push ? "decode-" + std::to_string(rec.decode_instance) : "prefill";
      Status s = round(push ? prefill : decode, {{"cmd", "raw"}, {"req", rec.id}, {"instance", other}}, 60s);
      for (const json& r : current_.replies) rec.raw_us = std::max(rec.raw_us, r.value("us", uint64_t{0}));
      if (!s.ok()) sum_.rank_errors.push_back("raw baseline: " + s.to_string());
    } else if (out->outcome == Outcome::kRecompute) {
      KVB_RETURN_IF_ERROR(round(decode, {{"cmd", "recompute"}, {"req", rec.id}, {"from", out->recompute_from}}, 60s));
      rec.recompute_from = out->recompute_from;
      for (const json& r : current_.replies) rec.verify_bad += r.value("verify_bad", uint64_t{0});
      rec.outcome = "recomputed";
    }
    if (out->outcome != Outcome::kFinished) (void)psched_.abort(rec.id, Clock::now());
    return end_request(rec, decode);
  }

  void inject(RequestRecord& rec, const std::vector<Proc*>& decode) {
    if (a_.inject == Inject::kCorrupt) return;     // at the check
    std::this_thread::sleep_for(a_.inject_after);  // let the transfers start
    Proc* victim = nullptr;
    if (a_.inject == Inject::kKillPrefill) victim = ranks_of(true, 0).front();
    if (a_.inject == Inject::kKillDecode) victim = decode.front();
    if (victim) {
      victim->killed = true;
      ::kill(victim->pid, SIGKILL);
      return;
    }
    if (a_.inject == Inject::kAbort) {
      // The engine aborts the request on both sides at once: the prefill
      // scheduler first, so that the readers' done messages (sent when
      // their cancelled loads end) release it as aborted, whenever they
      // arrive; it holds the blocks until then.
      (void)dscheds_[rec.decode_instance].abort(rec.id);
      (void)psched_.abort(rec.id, Clock::now());
      Status s = round(decode, {{"cmd", "abort"}, {"req", rec.id}}, 30s);
      if (!s.ok()) sum_.rank_errors.push_back("abort: " + s.to_string());
    }
  }

  // The decode instance frees the request's blocks (its ranks poison them).
  Status end_request(RequestRecord& rec, const std::vector<Proc*>& decode) {
    Status s = round(decode, {{"cmd", "free"}, {"req", rec.id}}, 30s);
    decode_blocks_.release_to(dpools_[rec.decode_instance]);
    decode_blocks_ = {};
    rec.flooded = flooding_;
    return s;
  }

  // Where every rank listens; then the floods of --flood and the pauser of
  // --inject pause, forked while this process still has no thread.
  Status start_hostiles() {
    std::vector<Flood::Target> targets;
    for (auto& p : ranks_.all()) {
      const std::string& host = (p->prefill ? a_.prefill : a_.decode).host;
      for (const std::string& l : p->listeners) {
        sum_.listeners.push_back(p->engine + " " + l);
        const std::string at = l.substr(0, l.rfind(':'));
        if (at != host && !(at == "[" + host + "]")) ++sum_.listeners_elsewhere;
      }
      if (p->prefill) targets.push_back({p->pid, p->listeners});
    }
    if (a_.flood > 0) {
      KVB_RETURN_IF_ERROR(flood_.start(targets, a_.flood));
      sum_.flood_connections = flood_.connections();
      sum_.flood_listeners = flood_.listeners();
      flooding_ = true;
    }
    if (a_.inject == Inject::kPause) {
      // Prefill rank 0 stops for 100 ms of every 300 ms, from the first
      // handshake to the last request.
      KVB_ASSIGN_OR_RETURN(pauser_, start_pauser(ranks_of(true, 0).front()->pid, 100ms, 300ms));
    }
    return Status();
  }

  void stop_flood() {
    flood_.stop(&sum_.listener_cpu_max_pct, &sum_.listener_cpu_max_thread);
    flooding_ = false;
  }

  void drain_leases() {
    const auto deadline = Clock::now() + a_.lease + 5s;
    while (psched_.held() != 0 && Clock::now() < deadline) pump(5ms);
  }

  void finish() {
    for (auto& p : ranks_.all()) {
      if (p->alive) (void)p->ch.send({{"cmd", "finish"}});
    }
    const auto deadline = Clock::now() + 60s;
    while (Clock::now() < deadline &&
           std::any_of(ranks_.all().begin(), ranks_.all().end(), [](auto& p) { return p->alive; })) {
      pump(5ms);
    }
    for (auto& p : ranks_.all()) {
      if (p->final) add_final(sum_, p->engine, *p->final);
    }
  }

  DemoArgs a_;
  Summary sum_;
  std::mt19937_64 rng_;
  uint64_t max_tokens_ = 0;
  Layout player_, dlayout_;
  std::set<std::string> pstate_groups_, dstate_groups_;  // state_pool_groups() of each side
  std::optional<InstancePools> ppool_;
  std::vector<InstancePools> dpools_;
  PrefillScheduler psched_;
  std::vector<DecodeScheduler> dscheds_;
  Ranks ranks_;
  std::map<RequestId, HeldBlocks> prefill_blocks_;
  HeldBlocks decode_blocks_;
  std::map<RequestId, std::vector<json>> loads_;
  std::vector<RequestOutcome> outcomes_;
  Current current_;
  std::map<RequestId, Clock::time_point> loaded_at_;  // the last decode rank's "loaded", per request
  Clock::time_point prefilled_at_{};                  // the last prefill rank's "prefilled" of the current request
  size_t prefilled_ = 0;                              // "prefilled" replies to the current request
  Flood flood_;
  bool flooding_ = false;
  Helper pauser_;
};

}  // namespace

int run(const DemoArgs& args) {
  Driver d(args);
  Status s = d.run();
  if (!s.ok()) {
    std::fprintf(stderr, "kvbridge: demo: %s\n", s.to_string().c_str());
    return 1;
  }
  print_report(d.summary());
  return clean(d.summary()) ? 0 : 1;
}

}  // namespace kvbridge::cli::demo

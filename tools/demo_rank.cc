// One rank process of `kvbridge demo` (demo.h): builds its layout, allocates
// and registers its tensors, runs a ConnectorWorker, and serves the driver's
// commands until "finish".
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "common/bytes.h"
#include "common/text.h"
#include "connector/worker_internal.h"
#include "demo.h"
#include "demo_baseline.h"
#include "demo_results.h"
#include "demo_runner.h"
#include "device/device.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "kvbridge/host_memory.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "proc_info.h"
#include "testing/engine_faults.h"
#include "testing/fake_side_channel.h"
#include "transport/staging.h"

#if KVB_HAVE_DISCOVERY
#include "connector/handshake.h"
#include "kvbridge/discovery.h"
#include "kvbridge/discovery_sync.h"
#endif

namespace kvbridge::cli::demo {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
constexpr uint8_t kSentinel = 0xa5;  // every decode byte no request holds

struct Held {
  Request request;
  uint64_t seed = 0;
  uint64_t start_ns = 0;  // how long start_load took to return
  bool loaded = false;    // its load ended well: "check" reads every byte
};

class Rank {
 public:
  Rank(const RankConfig& c, int fd) : c_(c), ch_(fd) {}

  Status init() {
    const DemoArgs& a = *c_.args;
    if (!c_.side.netns.empty()) {
      const std::string path = "/var/run/netns/" + c_.side.netns;
      const int ns = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) {
        return Status::unavailable("cannot enter network namespace " + path + ": " + std::strerror(errno));
      }
      ::close(ns);
      // As `ip netns exec` does: a private /sys that shows this namespace's
      // network devices (UCX finds its interfaces there).
      if (::unshare(CLONE_NEWNS) != 0 || ::mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0 ||
          ::umount2("/sys", MNT_DETACH) != 0 || ::mount(c_.side.netns.c_str(), "/sys", "sysfs", 0, nullptr) != 0) {
        return Status::unavailable("cannot remount /sys inside network namespace " + c_.side.netns + ": " +
                                   std::strerror(errno));
      }
    }
    PresetOptions p;
    p.name = a.preset;
    p.tp_size = c_.side.tp;
    p.tp_rank = c_.rank % c_.side.tp;
    p.pp_size = c_.side.pp;
    p.pp_rank = c_.rank / c_.side.tp;
    p.dcp_size = c_.side.dcp;
    p.dcp_interleave = c_.side.dcp_interleave;
    p.block_tokens = c_.side.block_tokens;
    p.kernel_block_tokens = c_.side.kernel_block_tokens;
    KVB_ASSIGN_OR_RETURN(p.order, parse_order(c_.side.order));
    p.num_blocks = c_.num_blocks;
    p.state_blocks = c_.state_blocks;
    KVB_ASSIGN_OR_RETURN(layout_, make_preset(p));
    if (c_.prefill && a.inject == Inject::kHash) layout_.dtype = "fp8_e4m3";  // a peer built for another dtype
    // The decode's memory holds the sentinel; the prefill's is touched by
    // its requests only, each request's blocks made resident before it is
    // admitted (make_resident).
    KVB_ASSIGN_OR_RETURN(mem_, RankMemory::allocate(layout_, c_.prefill ? std::nullopt : std::optional(kSentinel)));
    if (a.memory == "cuda") KVB_RETURN_IF_ERROR(mem_.to_device(layout_, c_.rank));
    WorkerOptions w;
    w.instance_id = c_.instance;
    w.side_channel_host = c_.side.host;
    w.secret = a.secret;
    w.transfer_timeout = a.transfer_timeout;
    w.verify_plans = a.verify_plans;
    w.verify_content = a.verify_content;
    w.load_chunk_tokens = a.chunk_tokens;
    w.stream_layers_per_stage = a.layers_per_stage;
    w.heartbeat_interval = std::clamp<std::chrono::milliseconds>(a.lease / 4, std::chrono::milliseconds(50),
                                                                 std::chrono::milliseconds(1000));
    // Pull: decode ranks read, and peers need no access to their memory.
    // Push: prefill ranks write into the decode ranks' memory (and still
    // grant reads: the raw baseline reads them).
    push_ = a.mode == "push";
    w.mode = push_ ? TransferMode::kPush : TransferMode::kPull;
    if (c_.prefill) {
      // Pull: a reader may read only the blocks handed off for the requests
      // it loads (enforced over tcp). Push: the raw baseline reads them.
      w.remote_access = push_ ? RemoteAccess::kRead : RemoteAccess::kGrantedRead;
    } else {
      // Push: each prefill rank may write only the blocks of a load in flight.
      w.remote_access = push_ ? RemoteAccess::kGrantedWrite : RemoteAccess::kNone;
    }
    if (c_.prefill) {
      if (a.inject == Inject::kWrongSecret || a.inject == Inject::kMissingSecret) w.secret = "prefill-secret";
    } else if (a.inject == Inject::kWrongSecret) {
      w.secret = "a-wrong-guess";
    }
    EngineOptions e;
    e.name = c_.instance + "/r" + std::to_string(c_.rank);
    engine_name_ = e.name;
    e.transports = {a.transport};
    e.host = c_.side.host;
    e.secret = w.secret;  // one trust for the side channel, control and data
    secret_ = w.secret;   // and discovery's records
    e.default_timeout = std::min<std::chrono::milliseconds>(a.transfer_timeout, std::chrono::seconds(5));
    // Faults that slow the copies go to the side that copies (the decode
    // ranks when they pull, the prefill ranks when they push), so that the
    // fault lands mid-transfer; a dropped done message to the decode ranks.
    std::string faults;
    const bool copies = c_.prefill == push_;
    switch (a.inject) {
      case Inject::kKillPrefill:
      case Inject::kKillDecode:
      case Inject::kAbort:
        if (copies) faults = "delay=5";
        break;
      case Inject::kStall:
        if (copies) faults = "delay=1000";
        break;
      case Inject::kDropNotification:
        if (!c_.prefill) faults = "drop-done=1";  // a reader's done message: it is asked again
        break;
      default:
        break;
    }
    KVB_ASSIGN_OR_RETURN(engine_, testing::create_engine_with_faults(e, faults));
    KVB_ASSIGN_OR_RETURN(worker_, ConnectorWorker::create(*engine_, layout_, mem_.registered(), w));
    std::string address = worker_->side_channel_address();
    if (c_.prefill &&
        (a.inject == Inject::kVersion || a.inject == Inject::kMalformed || a.inject == Inject::kTruncated)) {
      // A side channel that answers wrongly stands in front of the real one.
      testing::FakeSideChannel::Options f;
      f.mode = a.inject == Inject::kVersion     ? testing::FakeSideChannel::Mode::kOtherVersion
               : a.inject == Inject::kMalformed ? testing::FakeSideChannel::Mode::kGarbage
                                                : testing::FakeSideChannel::Mode::kTruncate;
      f.host = c_.side.host;
      f.secret = w.secret;
      f.real_address = address;
      f.identity = identity_text(layout_);
      f.hash = compatibility_hash(layout_);
      KVB_ASSIGN_OR_RETURN(fake_, testing::FakeSideChannel::start(std::move(f)));
      address = fake_->address();
    }
    return ch_.send({{"ev", "ready"},
                     {"side_channel", address},
                     {"engine", e.name},
                     {"listeners", listening_addresses(::getpid())}});
  }

  // Serves commands until "finish" or the driver goes away.
  Status loop() {
    KVB_RETURN_IF_ERROR(results_.start(worker_.get()));
    for (;;) {
      pollfd p[2] = {{ch_.fd(), POLLIN, 0}, {results_.fd(), POLLIN, 0}};
      ::poll(p, 2, 2);
      std::vector<json> in;
      KVB_RETURN_IF_ERROR(ch_.receive(in));
      for (const json& m : in) {
        if (m.value("cmd", "") == "finish") return finish();
        Status s = command(m);
        if (!s.ok()) KVB_RETURN_IF_ERROR(ch_.send({{"ev", "error"}, {"error", s.to_string()}}));
      }
      for (auto& [r, at_ns] : results_.take()) KVB_RETURN_IF_ERROR(loaded(r, at_ns));
      for (ReaderEvent& e : worker_->take_reader_events()) {
        KVB_RETURN_IF_ERROR(ch_.send({{"ev", "reader"},
                                      {"req", e.request},
                                      {"reader", e.reader},
                                      {"kind", e.kind == ReaderEvent::Kind::kDone ? "done" : "hb"}}));
      }
    }
  }

 private:
  // --etcd. "register" (prefill rank 0): the instance's record under a
  // lease, kept while this rank lives. "discover" (a decode rank): a watcher
  // feeding the worker (RemoteSync), then waits until the worker knows the
  // instance, so the loads that follow find it.
  Status discovery(const std::string& cmd, const json& m) {
#if KVB_HAVE_DISCOVERY
    EtcdOptions o;
    o.endpoint = m.at("etcd").get<std::string>();
    o.prefix = m.at("prefix").get<std::string>();
    o.secret = secret_;
    const std::string instance = m.at("instance").get<std::string>();
    if (cmd == "register") {
      InstanceRecord r;
      r.id = instance;
      r.role = "prefill";
      r.ranks = m.at("ranks").get<std::vector<std::string>>();
      r.identity = compatibility_hash_hex(layout_);
      r.protocol = connector::kHandshakeVersion;
      KVB_ASSIGN_OR_RETURN(registration_, Registration::create(o, r));
      return Status();
    }
    const auto t0 = Clock::now();
    RemoteSyncOptions so;
    so.identity = compatibility_hash_hex(layout_);
    sync_ = std::make_unique<RemoteSync>(*worker_, so);
    KVB_ASSIGN_OR_RETURN(watcher_, Watcher::create(o, sync_->callback()));
    // Known once RemoteSync has given it to add_remote() (and started its
    // handshake: an injected handshake fault then fails the loads, as it
    // does with static addresses).
    while (sync_->added().count(instance) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (Clock::now() - t0 > std::chrono::seconds(10)) {
        const Status why = sync_->last_error();
        return Status::timeout("instance '" + instance + "' not found in etcd at " + o.endpoint + " within 10 s" +
                               (why.ok() ? std::string() : ": " + why.to_string()));
      }
    }
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    return ch_.send({{"ev", "discovered"}, {"ms", ms}});
#else
    (void)m;
    return Status::unavailable(cmd + ": built without discovery");
#endif
  }

  Status command(const json& m) {
    const std::string cmd = m.value("cmd", "");
    const RequestId id = m.value("req", RequestId());
    if (cmd == "remote") {
      return worker_->add_remote(m.at("instance").get<std::string>(), m.at("ranks").get<std::vector<std::string>>());
    }
    if (cmd == "register" || cmd == "discover") return discovery(cmd, m);
    if (cmd == "resident") {
      KVB_ASSIGN_OR_RETURN(Request q, parse_request(m.at("request").dump()));
      KVB_RETURN_IF_ERROR(mem_.make_resident(layout_, q));
      return ch_.send({{"ev", "resident"}, {"req", id}});
    }
    if (cmd == "prefill" || cmd == "load") {
      KVB_ASSIGN_OR_RETURN(Request q, parse_request(m.at("request").dump()));
      held_[id] = Held{q, m.at("seed").get<uint64_t>()};
      if (cmd == "prefill") return prefill(id, q, m);
      const auto t0 = Clock::now();
      Status s = worker_->start_load(id, m.at("instance").get<std::string>(), q,
                                     LoadOptions::streaming(m.value("stream", false)));
      held_[id].start_ns =
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
      if (s.ok()) return s;
      LoadResult r;
      r.request = id;
      r.error = s;
      r.first_bad_token = q.skip_tokens;
      return loaded(r);
    }
    if (cmd == "push") {
      // Push mode, unstreamed: the KV is computed and the decode ranks are
      // loading; write it now, and report when every write ended.
      auto it = held_.find(id);
      if (it == held_.end()) return Status::not_found("push: request " + id + " was never prefilled here");
      const auto t0 = Clock::now();
      // The prefill waited for its device copies (sync()): nothing to wait on.
      LoadOptions o;
      o.ready.host_synchronized = mem_.on_device();
      Status s = worker_->push(id, m.at("to").get<std::string>(), it->second.request, o);
      const auto t1 = Clock::now();
      if (s.ok()) s = worker_->wait_for_save(id, c_.args->transfer_timeout);
      const auto us = [](Clock::duration d) {
        return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
      };
      return ch_.send({{"ev", "pushed"},
                       {"req", id},
                       {"ok", s.ok()},
                       {"error", s.ok() ? "" : s.to_string()},
                       {"plan_us", us(t1 - t0)},               // push(): the handshake the first time, and planning
                       {"write_us", us(Clock::now() - t1)}});  // until every write ended
    }
    if (cmd == "abort") {
      const auto t0 = Clock::now();
      Status s = worker_->abort(id);
      return ch_.send({{"ev", "aborted"},
                       {"req", id},
                       {"ok", s.ok()},
                       {"error", s.ok() ? "" : s.to_string()},
                       {"us", std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count()}});
    }
    if (cmd == "released") {
      // No reply: the driver frees the blocks after telling every prefill rank.
      worker_->blocks_released(id, m.value("readers", std::vector<std::string>{}));
      return Status();
    }
    if (cmd == "recompute") return recompute(id, m.at("from").get<uint64_t>());
    if (cmd == "raw") return raw(id, m.at("instance").get<std::string>());
    if (cmd == "check") return check(id, m.value("corrupt", "") == engine_name_);
    if (cmd == "free") {
      // The engine frees the request's blocks: poison them again, so that the
      // final scan finds any byte written later or outside the plan.
      auto it = held_.find(id);
      if (it != held_.end() && !c_.prefill) {
        KVB_RETURN_IF_ERROR(for_each_cell(layout_, it->second.request, RequestSide::kLocal, 0,
                                          [&](size_t t, uint64_t off, uint64_t n, uint64_t) {
                                            std::memset(mem_.host()[t].data() + off, kSentinel, n);
                                          }));
        KVB_RETURN_IF_ERROR(mem_.sync(layout_, it->second.request, RequestSide::kLocal, 0, true));
      }
      held_.erase(id);
      return ch_.send({{"ev", "freed"}, {"req", id}});
    }
    return Status::invalid_argument("unknown command '" + cmd + "'");
  }

  // The prefill's forward pass, layer by layer in the model's order: write
  // the layer's KV, compute (a busy loop) for the rest of the layer's time,
  // and when streaming announce it (save_layer) so the decode ranks read it
  // while the next is computed. A layer takes --compute-us-per-layer with its
  // KV write included, as an engine's layer writes its KV inside its kernels:
  // here the write runs on the CPU at memory speed, about as fast as the
  // copies, and outside the budget it would count every byte twice. Layers
  // whose write alone took longer are counted ("over_budget") and end when
  // their write does. The layers keep a fixed cadence: an engine's CPU
  // thread announces a layer while its GPU computes the next, so the
  // announcement's time comes out of the next layer's budget, not on top.
  Status prefill(RequestId id, const Request& q, const json& m) {
    const bool stream = m.value("stream", false);
    if (!push_) {
      std::map<std::string, std::vector<int64_t>> blocks;
      for (const auto& [group, ids] : q.blocks) blocks[group] = ids.remote;
      KVB_RETURN_IF_ERROR(worker_->hand_off(id, blocks));
    }
    const auto compute = std::chrono::microseconds(c_.args->compute_us_per_layer);
    if (stream && push_) {
      KVB_RETURN_IF_ERROR(worker_->push(id, m.at("to").get<std::string>(), q, LoadOptions::streaming(true)));
    } else if (stream) {
      KVB_RETURN_IF_ERROR(worker_->stream_to(id, m.at("to").get<std::string>()));
    }
    uint64_t layers = 0, over_budget = 0;
    if (!stream && compute.count() == 0) {
      KVB_RETURN_IF_ERROR(fill_request(layout_, q, RequestSide::kRemote, 0, held_[id].seed, mem_.host()));
      KVB_RETURN_IF_ERROR(mem_.sync(layout_, q, RequestSide::kRemote, 0, true));
    } else {
      Clock::time_point end = Clock::now();
      const std::vector<std::string> order = layer_order(layout_);
      for (size_t l = 0; l < order.size(); ++l) {
        const std::string& layer = order[l];
        end += compute;
        const Layout one = keep_layers(layout_, {layer});
        KVB_RETURN_IF_ERROR(fill_request(one, q, RequestSide::kRemote, 0, held_[id].seed, mem_.host()));
        // Streamed, device memory: the layer's copy is queued and announced
        // with its event, as an engine announces a layer its kernels still
        // write; the readers' copies wait on the event.
        const bool queued = stream && mem_.on_device();
        if (queued && c_.args->producer_delay_us > 0) {
          KVB_RETURN_IF_ERROR(device::current().fill_after(mem_.stream(), mem_.registered()[0].data(), 0, 0,
                                                           std::chrono::microseconds(c_.args->producer_delay_us)));
        }
        KVB_RETURN_IF_ERROR(mem_.sync(one, q, RequestSide::kRemote, 0, true, queued));
        Readiness ready;
        if (queued) {
          KVB_RETURN_IF_ERROR(device::current().record(mem_.layer_event(l), mem_.stream()));
          if (push_) {
            ready.event = reinterpret_cast<uintptr_t>(mem_.layer_event(l));
          } else if (c_.args->prefill.netns != c_.args->decode.netns) {
            // The readers are on another host, where an IPC event handle
            // does not open: the layer is announced once the host saw its
            // event complete.
            KVB_RETURN_IF_ERROR(transport::await_event(device::current(), mem_.layer_event(l), nullptr));
            ready.host_synchronized = true;
          } else {
            ready.event_handle = mem_.layer_handle(l);
          }
        }
        ++layers;
        if (const Clock::time_point now = Clock::now(); now >= end) {
          if (compute.count() > 0) ++over_budget;
          end = now;
        }
        busy_until(end);
        if (stream) KVB_RETURN_IF_ERROR(worker_->save_layer(id, layer, ready));
      }
    }
    const int64_t done_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
    KVB_RETURN_IF_ERROR(ch_.send(
        {{"ev", "prefilled"}, {"req", id}, {"at_ns", done_ns}, {"layers", layers}, {"over_budget", over_budget}}));
    // A reader that is gone fails its announcements (counted in the
    // worker's notifications_failed); its lease frees the blocks.
    if (stream) (void)worker_->wait_for_save(id, c_.args->transfer_timeout);
    return Status();
  }

  // A load ended: report it. Its bytes are checked on "check", once every
  // decode rank's load of the request ended: a check here, as large a read
  // of memory as the transfer, would take CPU and memory bandwidth from the
  // other ranks' transfers of the request and skew their figures.
  // `known_ns`: when this rank knew its KV had arrived (the driver's TTFT
  // ends there; CLOCK_MONOTONIC is one clock for every process of the
  // host); 0: now.
  Status loaded(const LoadResult& r, int64_t known_ns = 0) {
    if (known_ns == 0) {
      known_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
    }
    json out = {{"ev", "loaded"},
                {"at_ns", known_ns},
                {"req", r.request},
                {"ok", r.error.ok()},
                {"aborted", r.aborted},
                {"error", r.error.ok() ? "" : r.error.to_string()},
                {"code", std::string(code_name(r.error.code()))},
                {"first_bad_token", r.first_bad_token},
                {"bytes", r.bytes},
                {"descriptors", r.descriptors},
                {"naive", r.naive_descriptors},
                {"transfer_us", r.transfer_time.count()},
                {"last_stage_us", r.last_stage_time.count()},
                {"completion_lag_us", r.completion_lag.count()}};
    auto it = held_.find(r.request);
    if (it != held_.end()) {
      out["start_ns"] = it->second.start_ns;
      it->second.loaded = r.error.ok();
    }
    return ch_.send(out);
  }

  // Checks every byte a load that ended well was to bring (nothing for one
  // that failed: its request is recomputed or reported failed). With
  // `corrupt` (--inject corrupt), first flips the first byte of its KV.
  Status check(RequestId id, bool corrupt) {
    json out = {{"ev", "checked"}, {"req", id}, {"verify_bad", 0}, {"verify_error", ""}, {"verify_bytes", 0}};
    auto it = held_.find(id);
    if (it != held_.end() && it->second.loaded) {
      const Request& q = it->second.request;
      KVB_RETURN_IF_ERROR(mem_.sync(layout_, q, RequestSide::kLocal, q.skip_tokens, false));
      bool flipped = !corrupt;
      KVB_RETURN_IF_ERROR(for_each_cell(layout_, q, RequestSide::kLocal, q.skip_tokens,
                                        [&](size_t t, uint64_t off, uint64_t n, uint64_t) {
                                          if (flipped || n == 0) return;
                                          mem_.host()[t][off] ^= 0xFF;
                                          flipped = true;
                                        }));
      KVB_ASSIGN_OR_RETURN(ContentReport c,
                           check_request(layout_, q, RequestSide::kLocal, q.skip_tokens, it->second.seed, mem_.host()));
      out["verify_bad"] = c.bad_cells;
      out["verify_error"] = c.first_error;
      out["verify_bytes"] = c.bytes;
    }
    return ch_.send(out);
  }

  // Policy recompute: the engine recomputes the KV from token `from` (here:
  // writes what prefill would have), and the whole request is checked.
  Status recompute(RequestId id, uint64_t from) {
    auto it = held_.find(id);
    if (it == held_.end()) return Status::not_found("request " + q(id) + " is not held");
    const Request& q = it->second.request;
    KVB_RETURN_IF_ERROR(mem_.sync(layout_, q, RequestSide::kLocal, q.skip_tokens, false));
    KVB_RETURN_IF_ERROR(fill_request(layout_, q, RequestSide::kLocal, from, it->second.seed, mem_.host()));
    KVB_RETURN_IF_ERROR(mem_.sync(layout_, q, RequestSide::kLocal, from, true));
    KVB_ASSIGN_OR_RETURN(ContentReport c,
                         check_request(layout_, q, RequestSide::kLocal, q.skip_tokens, it->second.seed, mem_.host()));
    return ch_.send({{"ev", "recomputed"}, {"req", id}, {"verify_bad", c.bad_cells}, {"verify_error", c.first_error}});
  }

  // The baseline (demo_baseline.h), on this thread: a decode rank reads its
  // plan's descriptors from `instance`'s ranks; in push mode a prefill rank
  // writes the descriptors whose bytes it holds into `instance`'s ranks.
  Status raw(RequestId id, const std::string& instance) {
    // Device memory has no process_vm_readv baseline (kvbridge bench
    // --memory cuda measures cudaMemcpy baselines).
    if (mem_.on_device()) return ch_.send({{"ev", "raw"}, {"req", id}, {"us", 0}, {"bytes", 0}});
    auto it = held_.find(id);
    if (it == held_.end()) return Status::not_found("request " + q(id) + " is not held");
    const bool write = push_ && c_.prefill;
    KVB_ASSIGN_OR_RETURN(std::vector<connector_internal::RemoteRankView> peers,
                         connector_internal::remote_ranks(*worker_, instance));
    std::vector<PeerCopies> copies;
    if (write) {
      KVB_ASSIGN_OR_RETURN(std::vector<connector_internal::RemoteRankView> own,
                           connector_internal::remote_ranks(*worker_, "prefill"));
      KVB_ASSIGN_OR_RETURN(copies, writes_of(layout_, mem_.registered(), peers, own, it->second.request));
    } else {
      KVB_ASSIGN_OR_RETURN(copies, reads_of(layout_, mem_.registered(), peers, it->second.request));
    }
    // The load read its bytes from memory (the prefill writes them past the
    // caches); so does the baseline: the caches are emptied first.
    evictor_.evict();
    KVB_ASSIGN_OR_RETURN(TimedCopies t, time_copies(copies, write));
    return ch_.send({{"ev", "raw"}, {"req", id}, {"us", t.us}, {"bytes", t.bytes}});
  }

  // Every byte no request holds must still be the sentinel.
  Status finish() {
    uint64_t stray = 0;
    std::string first;
    if (!c_.prefill) {
      for (size_t t = 0; t < mem_.host().size(); ++t) {
        KVB_RETURN_IF_ERROR(mem_.pull(t));
        const OtherBytes other = other_bytes(mem_.host()[t], kSentinel);
        if (other.count > 0 && stray == 0) {
          first = "tensor '" + layout_.tensors[t].name + "' offset " + std::to_string(other.first);
        }
        stray += other.count;
      }
    }
    const WorkerStats s = worker_->stats();
    const EngineMetrics m = engine_->metrics();
    const transport::WireCounts wire = transport::tcp_wire_counts();
    return ch_.send({{"ev", "final"},
                     {"wire_frames", wire.frames},
                     {"wire_bytes", wire.bytes},
                     {"wire_small_frames", wire.small},
                     {"staged_chunks", transport::staged_chunks()},
                     {"stray_bytes", stray},
                     {"first_stray", first},
                     {"held", held_.size()},
                     {"handshakes", s.handshakes},
                     {"served", s.handshakes_served},
                     {"rejected", s.handshakes_rejected},
                     {"last_rejection", s.last_rejection},
                     {"notifications_failed", s.notifications_failed},
                     {"plans_verified", s.plans_verified},
                     {"content_checked", m.bytes_content_checked},
                     {"content_check_failures", m.content_check_failures},
                     {"last_notification_error", s.last_notification_error},
                     {"transfers_failed", m.transfers_failed},
                     {"transfers_cancelled", m.transfers_cancelled}});
  }

  const RankConfig& c_;
  Channel ch_;
  Layout layout_;
  RankMemory mem_;           // the tensors (device memory and a host mirror with --memory cuda)
  std::string engine_name_;  // this rank's engine name
  std::string secret_;       // the deployment's (signs and checks etcd records)
  CacheEvictor evictor_;     // raw()'s
  bool push_ = false;        // --mode push
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ConnectorWorker> worker_;
  ResultWaiter results_;                            // after worker_: its thread is joined before worker_ goes
  std::unique_ptr<testing::FakeSideChannel> fake_;  // --inject version|malformed|truncated
#if KVB_HAVE_DISCOVERY
  // --etcd; the watcher goes first (it feeds sync_, which feeds worker_).
  std::unique_ptr<Registration> registration_;
  std::unique_ptr<RemoteSync> sync_;
  std::unique_ptr<Watcher> watcher_;
#endif
  std::map<RequestId, Held> held_;
};

}  // namespace

void rank_main(const RankConfig& config, int fd) {
  int code = 0;
  {
    Rank rank(config, fd);
    Status s = rank.init();
    if (s.ok()) s = rank.loop();
    if (!s.ok()) {
      Channel ch(::dup(fd));
      (void)ch.send({{"ev", "fatal"}, {"error", s.to_string()}});
      code = 1;
    }
  }
  std::fflush(nullptr);
  ::_exit(code);
}

}  // namespace kvbridge::cli::demo

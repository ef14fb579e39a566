// How long ConnectorWorker::start_load() takes to return: against a silent
// peer (its side channel accepts and never answers: the load waits for a
// handshake that cannot finish), and against a connected prefill rank (the
// start thread plans and submits a 4096-token llama3-8b request). The
// baseline in the same run is one uncontended mutex hand-off to a waiting
// thread (lock, push, unlock, notify), the least a queueing call can cost.
// The Time column is each call's wall time (the waits for results and the
// aborts between calls are not timed); CPU is the calling thread's. On a
// machine with fewer cores than busy threads the wall time of the connected
// case includes the caller waiting for a CPU while the worker's start and
// engine threads run the previous and the new load.
//
// BM_LoadHostCost: a load's cost to the host, without its copies:
// llama3-70b at 128k tokens (5.4 GB per TP 8 rank), a TP 8 prefill instance
// to decode rank 0 of TP 8 or TP 2, shuffled block ids, the worker's
// default cut (chunks of load_chunk_tokens). Every tensor is virtual memory
// that nothing touches, and the decode engine's runs report their bytes
// without copying them (testing fault skip-copies: maxrss_mb shows nothing
// was copied), so what is measured is the host's work: planning, the
// engine's resolve and submit, completion and the done messages. The
// streamed row loads the same request with LoadOptions::streaming(): every
// prefill rank announces its 80 layers at once (save_layer()), and the load
// moves in a stage per layer (80), each read on its own; the
// whole decode instance exists and knows the prefill instance (the
// announcements go to the ranks that read them).
// Counters:
//   first_ms   start_load() to its result, the first load of the shape
//              (planned afresh, as every load was before stage templates)
//   second_ms  the same for the second, which builds the shape's template
//   load_ms    the same for the loads after it (from the template); the
//              figures below are theirs too
//   submit_ms  start_load() to its last read submitted (LoadResult::
//              submit_time), later loads: wall time, on this machine's two
//              cores shared with the engine threads already running the
//              first stages' reads
//   submit_cpu_ms  the CPU time of that work (LoadResult::submit_cpu_time:
//              planning, checking, submitting), the figure the target is
//              about
//   submit_pct submit_cpu_ms / hbm_ms in percent (target: at most 20)
//   cpu_ms     the process's CPU time (every thread) of one later load
//   hbm_ms     the load's bytes at 1.5 TB/s (a GPU's copy rate, computed)
//   cpu_pct    cpu_ms / hbm_ms in percent
//   reads      the decode engine's transfers per later load (a read per
//              stage and source)
//   wakeups    the times per later load the decode engine's sleeping
//              threads were woken for its reads (a load's reads are one
//              batch of submits, Engine::begin_batch())
//   announced  streamed: the layer announcements the prefill ranks sent per
//              later load (a rank that reads nothing from a prefill rank
//              answers its first one "unread" and gets no more)
//   descriptors, bytes: the load's
#include <arpa/inet.h>
#include <benchmark/benchmark.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/connector.h"
#include "kvbridge/presets.h"
#include "testing/engine_faults.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;

struct Rank {
  Layout layout;
  std::vector<std::vector<uint8_t>> mem;
  std::vector<std::span<uint8_t>> spans;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ConnectorWorker> worker;
};

std::unique_ptr<Rank> make_rank(const std::string& id, uint64_t num_blocks) {
  auto r = std::make_unique<Rank>();
  r->layout = *make_preset(PresetOptions{.name = "llama3-8b", .num_blocks = num_blocks});
  for (const Tensor& t : r->layout.tensors) r->mem.emplace_back(t.bytes, 0);
  for (auto& m : r->mem) r->spans.emplace_back(m);
  EngineOptions e;
  e.name = id + "/r0";
  e.transports = {"local"};
  r->engine = std::move(*Engine::create(e));
  WorkerOptions w;
  w.instance_id = id;
  w.handshake_timeout = 60s;
  r->worker = std::move(*ConnectorWorker::create(*r->engine, r->layout, r->spans, w));
  return r;
}

Request whole(uint64_t tokens, uint64_t block_tokens) {
  Request q;
  q.num_tokens = tokens;
  GroupBlocks& b = q.blocks["full"];
  for (uint64_t i = 0; i < (tokens + block_tokens - 1) / block_tokens; ++i) {
    b.local.push_back(static_cast<int64_t>(i));
    b.remote.push_back(static_cast<int64_t>(i));
  }
  return q;
}

void BM_StartLoadSilentPeer(benchmark::State& state) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 64) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    state.SkipWithError("cannot listen on loopback");
    return;
  }
  auto d = make_rank("decode", 512);
  (void)d->worker->add_remote("silent", {"127.0.0.1:" + std::to_string(ntohs(a.sin_port))});
  const Request q = whole(4096, 16);
  uint64_t n = 0;
  for (auto _ : state) {
    const std::string id = "req-" + std::to_string(n++);
    if (!d->worker->start_load(id, "silent", q).ok()) state.SkipWithError("start_load failed");
    state.PauseTiming();
    (void)d->worker->abort(id);
    (void)d->worker->take_results();
    state.ResumeTiming();
  }
  d.reset();
  ::close(fd);
}

void BM_StartLoadConnected(benchmark::State& state) {
  auto p = make_rank("prefill", 512);
  auto d = make_rank("decode", 512);
  (void)d->worker->add_remote("prefill", {p->worker->side_channel_address()});
  if (!d->worker->wait_connected("prefill", 10s).ok()) {
    state.SkipWithError("cannot connect");
    return;
  }
  const Request q = whole(4096, 16);
  uint64_t n = 0;
  for (auto _ : state) {
    const std::string id = "req-" + std::to_string(n++);
    if (!d->worker->start_load(id, "prefill", q).ok()) state.SkipWithError("start_load failed");
    state.PauseTiming();
    std::vector<LoadResult> r;
    while (r.empty()) {
      d->worker->wait_results(100ms);
      r = d->worker->take_results();
    }
    if (!r.front().error.ok()) state.SkipWithError(r.front().error.to_string().c_str());
    state.ResumeTiming();
  }
}

// A rank of llama3-70b whose tensors are untouched virtual memory.
struct BigRank {
  Layout layout;
  std::vector<std::span<uint8_t>> spans;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ConnectorWorker> worker;
  ~BigRank() {
    worker.reset();
    engine.reset();
    for (std::span<uint8_t> s : spans) ::munmap(s.data(), s.size());
  }
};

Result<std::unique_ptr<BigRank>> big_rank(const std::string& id, uint32_t tp, uint32_t rank, uint64_t num_blocks,
                                          std::string_view faults, std::string transport = "local",
                                          RemoteAccess access = RemoteAccess::kRead,
                                          TransferMode mode = TransferMode::kPull) {
  auto r = std::make_unique<BigRank>();
  KVB_ASSIGN_OR_RETURN(
      r->layout,
      make_preset(PresetOptions{
          .name = "llama3-70b", .tp_size = tp, .tp_rank = rank, .block_tokens = 16, .num_blocks = num_blocks}));
  for (const Tensor& t : r->layout.tensors) {
    void* m = ::mmap(nullptr, t.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return Status::resource_exhausted("mmap of " + std::to_string(t.bytes) + " bytes failed");
    r->spans.emplace_back(static_cast<uint8_t*>(m), t.bytes);
  }
  EngineOptions e;
  e.name = id + "/r" + std::to_string(rank);
  e.transports = {std::move(transport)};
  KVB_ASSIGN_OR_RETURN(r->engine, testing::create_engine_with_faults(e, faults));
  WorkerOptions w;
  w.instance_id = id;
  w.remote_access = access;
  w.mode = mode;
  w.handshake_timeout = 60s;
  KVB_ASSIGN_OR_RETURN(r->worker, ConnectorWorker::create(*r->engine, r->layout, r->spans, w));
  return r;
}

// A request of `tokens` in 16-token blocks of group "full", its ids
// shuffled on both sides (the same every call).
Request shuffled(uint64_t tokens) {
  Request q;
  q.num_tokens = tokens;
  GroupBlocks& b = q.blocks["full"];
  for (uint64_t i = 0; i < tokens / 16; ++i) b.local.push_back(static_cast<int64_t>(i));
  b.remote = b.local;
  std::mt19937_64 rng(0x6b7662);
  std::shuffle(b.local.begin(), b.local.end(), rng);
  std::shuffle(b.remote.begin(), b.remote.end(), rng);
  return q;
}

double process_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void BM_LoadHostCost(benchmark::State& state, uint32_t decode_tp, bool stream = false) {
  constexpr uint64_t kTokens = 128 * 1024, kBlocks = kTokens / 16, kNumBlocks = kBlocks + 64;
  std::vector<std::unique_ptr<BigRank>> prefill;
  std::vector<std::string> addresses;
  for (uint32_t r = 0; r < 8; ++r) {
    Result<std::unique_ptr<BigRank>> p = big_rank("prefill", 8, r, kNumBlocks, "");
    if (!p.ok()) return state.SkipWithError(p.error().to_string().c_str());
    addresses.push_back((*p)->worker->side_channel_address());
    prefill.push_back(std::move(*p));
  }
  Result<std::unique_ptr<BigRank>> d = big_rank("decode", decode_tp, 0, kNumBlocks, "skip-copies=1");
  if (!d.ok()) return state.SkipWithError(d.error().to_string().c_str());
  ConnectorWorker& w = *(*d)->worker;
  if (!w.add_remote("prefill", addresses).ok() || !w.wait_connected("prefill", 60s).ok()) {
    return state.SkipWithError("cannot connect to the prefill instance");
  }
  const std::vector<std::string> layers = layer_order((*d)->layout);
  std::vector<std::unique_ptr<BigRank>> others;  // a streamed load's prefill ranks announce to the whole instance
  std::vector<std::string> decode_addresses{w.side_channel_address()};
  for (uint32_t r = 1; stream && r < decode_tp; ++r) {
    Result<std::unique_ptr<BigRank>> o = big_rank("decode", decode_tp, r, kNumBlocks, "skip-copies=1");
    if (!o.ok()) return state.SkipWithError(o.error().to_string().c_str());
    // Each decode rank knows the prefill instance, as in a deployment
    // (they all load): a rank that reads nothing from a prefill rank says
    // so when that rank announces a layer to it.
    Status known = (*o)->worker->add_remote("prefill", addresses);
    if (known.ok()) known = (*o)->worker->wait_connected("prefill", 60s);
    if (!known.ok()) return state.SkipWithError(known.to_string().c_str());
    decode_addresses.push_back((*o)->worker->side_channel_address());
    others.push_back(std::move(*o));
  }
  if (stream) {
    for (auto& p : prefill) {
      Status added = p->worker->add_remote("decode", decode_addresses);
      if (added.ok()) added = p->worker->wait_connected("decode", 60s);
      if (!added.ok()) return state.SkipWithError(added.to_string().c_str());
    }
  }
  const Request q = shuffled(kTokens);  // one shape for every load
  uint64_t n = 0, later = 0, reads = 0, announced = 0, wakeups = 0;
  double first_ms = 0, second_ms = 0, wall = 0, cpu = 0, submit = 0, submit_cpu = 0;
  LoadResult last;
  auto announcements = [&] {
    uint64_t sent = 0;
    for (auto& p : prefill) sent += p->worker->stats().announcements_sent;
    return sent;
  };
  for (auto _ : state) {
    const std::string id = "req-" + std::to_string(n);
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = process_cpu_seconds();
    const uint64_t reads0 = (*d)->engine->metrics().transfers_submitted;
    const uint64_t wakeups0 = (*d)->engine->metrics().worker_wakeups;
    const uint64_t announced0 = announcements();
    if (!w.start_load(id, "prefill", q, LoadOptions::streaming(stream)).ok()) {
      return state.SkipWithError("start_load failed");
    }
    if (stream) {
      // Every prefill rank has its layers ready at once: what is measured
      // is a stage per layer, not the wait for them.
      for (auto& p : prefill) {
        if (!p->worker->stream_to(id, "decode").ok()) return state.SkipWithError("stream_to failed");
        for (const std::string& l : layers) {
          if (!p->worker->save_layer(id, l).ok()) return state.SkipWithError("save_layer failed");
        }
      }
    }
    std::vector<LoadResult> r;
    while (r.empty()) {
      w.wait_results(100ms);
      r = w.take_results();
    }
    const double c1 = process_cpu_seconds();
    const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.front().error.ok()) return state.SkipWithError(r.front().error.to_string().c_str());
    last = r.front();
    if (n == 0) first_ms = ms;
    if (n == 1) second_ms = ms;
    if (n++ >= 2) {
      wall += ms;
      cpu += 1e3 * (c1 - c0);
      submit += 1e-3 * static_cast<double>(r.front().submit_time.count());
      submit_cpu += 1e-3 * static_cast<double>(r.front().submit_cpu_time.count());
      reads += (*d)->engine->metrics().transfers_submitted - reads0;
      wakeups += (*d)->engine->metrics().worker_wakeups - wakeups0;
      announced += announcements() - announced0;
      ++later;
    }
  }
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const double hbm_ms = 1e3 * static_cast<double>(last.bytes) / 1.5e12;
  const double cpu_ms = later > 0 ? cpu / static_cast<double>(later) : 0;
  state.counters["reads"] = later > 0 ? static_cast<double>(reads) / static_cast<double>(later) : 0;
  state.counters["wakeups"] = later > 0 ? static_cast<double>(wakeups) / static_cast<double>(later) : 0;
  if (stream) state.counters["announced"] = later > 0 ? static_cast<double>(announced) / static_cast<double>(later) : 0;
  state.counters["first_ms"] = first_ms;
  state.counters["second_ms"] = second_ms;
  state.counters["load_ms"] = later > 0 ? wall / static_cast<double>(later) : 0;
  state.counters["cpu_ms"] = cpu_ms;
  state.counters["hbm_ms"] = hbm_ms;
  state.counters["cpu_pct"] = hbm_ms > 0 ? 100.0 * cpu_ms / hbm_ms : 0;
  const double submit_ms = later > 0 ? submit / static_cast<double>(later) : 0;
  state.counters["submit_ms"] = submit_ms;
  const double submit_cpu_ms = later > 0 ? submit_cpu / static_cast<double>(later) : 0;
  state.counters["submit_cpu_ms"] = submit_cpu_ms;
  state.counters["submit_pct"] = hbm_ms > 0 ? 100.0 * submit_cpu_ms / hbm_ms : 0;
  state.counters["descriptors"] = static_cast<double>(last.descriptors);
  state.counters["bytes"] = static_cast<double>(last.bytes);
  state.counters["maxrss_mb"] = static_cast<double>(u.ru_maxrss) / 1024.0;
}

double thread_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// BM_PushHostCost: the same request in push mode (the prefill ranks write
// into the decode ranks' blocks), its cost to the host without its copies:
// llama3-70b at 128k tokens, TP 8 to TP 8, shuffled ids, prefill rank 0
// writing decode rank 0's part (the prefill engines' runs report their
// bytes without copying them), the decode ranks granting their writers
// only the request's bytes (granted_write). The streamed row pushes with
// LoadOptions::streaming() and prefill rank 0 saves its 80 layers at once
// (save_layer()), each written as it is saved. Counters, the loads after
// the second (from templates):
//   push_ms      prefill rank 0's push() (it plans on the caller's thread
//                and submits the writes), and streamed its save_layer()s
//   push_cpu_ms  the CPU time of those calls
//   grant_cpu_ms decode rank 0's start_load() work, on its worker's start
//                thread (planning, and granting the writer the places it
//                writes: LoadResult::submit_cpu_time)
//   load_ms      start_load() to its result
//   cpu_ms       the process's CPU time (every thread) of one load
//   hbm_ms, cpu_pct, descriptors, bytes: as BM_LoadHostCost's
void BM_PushHostCost(benchmark::State& state, bool stream) {
  constexpr uint64_t kTokens = 128 * 1024, kBlocks = kTokens / 16, kNumBlocks = kBlocks + 64;
  std::vector<std::unique_ptr<BigRank>> prefill, decode;
  std::vector<std::string> paddr, daddr;
  for (uint32_t r = 0; r < 8; ++r) {
    Result<std::unique_ptr<BigRank>> p =
        big_rank("prefill", 8, r, kNumBlocks, "skip-copies=1", "local", RemoteAccess::kNone, TransferMode::kPush);
    if (!p.ok()) return state.SkipWithError(p.error().to_string().c_str());
    paddr.push_back((*p)->worker->side_channel_address());
    prefill.push_back(std::move(*p));
    Result<std::unique_ptr<BigRank>> d =
        big_rank("decode", 8, r, kNumBlocks, "", "local", RemoteAccess::kGrantedWrite, TransferMode::kPush);
    if (!d.ok()) return state.SkipWithError(d.error().to_string().c_str());
    daddr.push_back((*d)->worker->side_channel_address());
    decode.push_back(std::move(*d));
  }
  ConnectorWorker& w = *decode[0]->worker;
  ConnectorWorker& p = *prefill[0]->worker;
  if (!w.add_remote("prefill", paddr).ok() || !w.wait_connected("prefill", 60s).ok() ||
      !p.add_remote("prefill", paddr).ok() || !p.add_remote("decode", daddr).ok() ||
      !p.wait_connected("decode", 60s).ok() || !p.wait_connected("prefill", 60s).ok()) {
    return state.SkipWithError("cannot connect the instances");
  }
  const Request q = shuffled(kTokens);
  const std::vector<std::string> layers = layer_order(prefill[0]->layout);
  uint64_t n = 0, later = 0;
  double push_ms = 0, push_cpu = 0, grant_cpu = 0, wall = 0, cpu = 0;
  LoadResult last;
  for (auto _ : state) {
    const std::string id = "req-" + std::to_string(n);
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = process_cpu_seconds();
    if (!w.start_load(id, "prefill", q, LoadOptions::streaming(stream)).ok()) {
      return state.SkipWithError("start_load failed");
    }
    const auto p0 = std::chrono::steady_clock::now();
    const double pc0 = thread_cpu_seconds();
    Status pushed = p.push(id, "decode", q, LoadOptions::streaming(stream));
    // Streamed: every layer saved at once, each written as it is saved.
    for (size_t l = 0; pushed.ok() && stream && l < layers.size(); ++l) pushed = p.save_layer(id, layers[l]);
    if (!pushed.ok()) return state.SkipWithError(pushed.to_string().c_str());
    const double pc1 = thread_cpu_seconds();
    const double pms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
    if (Status s = p.wait_for_save(id, 60000ms); !s.ok()) return state.SkipWithError(s.to_string().c_str());
    std::vector<LoadResult> r;
    while (r.empty()) {
      w.wait_results(100ms);
      r = w.take_results();
    }
    const double c1 = process_cpu_seconds();
    const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.front().error.ok()) return state.SkipWithError(r.front().error.to_string().c_str());
    last = r.front();
    if (n++ >= 2) {
      push_ms += pms;
      push_cpu += 1e3 * (pc1 - pc0);
      grant_cpu += 1e-3 * static_cast<double>(r.front().submit_cpu_time.count());
      wall += ms;
      cpu += 1e3 * (c1 - c0);
      ++later;
    }
  }
  const double k = later > 0 ? static_cast<double>(later) : 1;
  const double hbm_ms = 1e3 * static_cast<double>(last.bytes) / 1.5e12;
  state.counters["push_ms"] = push_ms / k;
  state.counters["push_cpu_ms"] = push_cpu / k;
  state.counters["grant_cpu_ms"] = grant_cpu / k;
  state.counters["load_ms"] = wall / k;
  state.counters["cpu_ms"] = cpu / k;
  state.counters["hbm_ms"] = hbm_ms;
  state.counters["cpu_pct"] = hbm_ms > 0 ? 100.0 * (cpu / k) / hbm_ms : 0;
  state.counters["descriptors"] = static_cast<double>(last.descriptors);
  state.counters["bytes"] = static_cast<double>(last.bytes);
}

// What read grants cost a prefill rank (llama3-70b, TP 8, a request of
// 128k tokens in 8,192 shuffled blocks, every other block of the cache, so
// that no two are adjacent: 655,360 places, the most; over tcp): hand_off() on the
// engine's step (it only checks), the request's places (block_places(), once
// per hand-off, on the worker's pump: one tensor's spans and their repeats
// in the others), the engine's grant of them to the
// first reader, their share with each other reader (a decode instance's
// ranks), and the revokes (at blocks_released()). The copies themselves are
// not part of it.
void BM_ReadGrants(benchmark::State& state) {
  constexpr uint64_t kTokens = 128 * 1024, kBlocks = kTokens / 16, kNumBlocks = 2 * kBlocks + 64;
  Result<std::unique_ptr<BigRank>> p = big_rank("prefill", 8, 0, kNumBlocks, "", "tcp", RemoteAccess::kGrantedRead);
  if (!p.ok()) return state.SkipWithError(p.error().to_string().c_str());
  BigRank& r = **p;
  std::vector<int64_t> ids;
  for (uint64_t i = 0; i < kBlocks; ++i) ids.push_back(static_cast<int64_t>(2 * i));
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(0x6b7662));
  std::vector<RegionId> regions;  // the worker's registrations: the same ranges again
  for (std::span<uint8_t> s : r.spans) {
    Result<RegionId> id = r.engine->register_memory(s.data(), s.size(), "host", RemoteAccess::kGrantedRead);
    if (!id.ok()) return state.SkipWithError(id.error().to_string().c_str());
    regions.push_back(*id);
  }
  const Group& g = *r.layout.find_group("full");
  double hand_off_us = 0, spans_ms = 0, grant_ms = 0, share_us = 0, revoke_ms = 0;
  uint64_t n = 0, spans = 0, repeated = 0;
  auto ms_since = [](std::chrono::steady_clock::time_point t0) {
    return 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    const std::string id = "req-" + std::to_string(n++);
    auto t0 = std::chrono::steady_clock::now();
    if (!r.worker->hand_off(id, {{"full", ids}}).ok()) return state.SkipWithError("hand_off failed");
    hand_off_us += 1e3 * ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    Result<BlockPlaces> s = block_places(r.layout, g, ids);
    if (!s.ok()) return state.SkipWithError(s.error().to_string().c_str());
    std::vector<WriteGrant> ranges;
    std::vector<GrantRepeat> repeats;
    ranges.reserve(s->spans.size());
    for (const TensorSpan& t : s->spans) ranges.push_back({regions[t.tensor], t.offset, t.bytes});
    for (const BlockPlaces::Repeat& t : s->repeats) repeats.push_back({t.first, t.count, regions[t.tensor], t.shift});
    spans_ms += ms_since(t0);
    spans = s->spans.size();
    repeated = s->repeats.size();
    t0 = std::chrono::steady_clock::now();
    Result<GrantId> grant = r.engine->grant_reads("decode/r0", 0x1234, ranges, repeats);
    if (!grant.ok()) return state.SkipWithError(grant.error().to_string().c_str());
    grant_ms += ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    Result<GrantId> shared = r.engine->share_reads(*grant, "decode/r1", 0x1234);
    if (!shared.ok()) return state.SkipWithError(shared.error().to_string().c_str());
    share_us += 1e3 * ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    r.engine->revoke_reads(*grant);
    r.engine->revoke_reads(*shared);
    revoke_ms += ms_since(t0);
    r.worker->blocks_released(id);
  }
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const double k = static_cast<double>(n);
  state.counters["spans"] = static_cast<double>(spans);
  state.counters["repeats"] = static_cast<double>(repeated);
  state.counters["hand_off_us"] = hand_off_us / k;
  state.counters["spans_ms"] = spans_ms / k;
  state.counters["grant_ms"] = grant_ms / k;
  state.counters["share_us"] = share_us / k;
  state.counters["revoke_ms"] = revoke_ms / k;
  state.counters["maxrss_mb"] = static_cast<double>(u.ru_maxrss) / 1024.0;
}

// The baseline: hand one item to a thread waiting on a condition variable.
void BM_BaselineHandOff(benchmark::State& state) {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Request> q;
  bool stop = false;
  std::thread t([&] {
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      cv.wait(lock, [&] { return stop || !q.empty(); });
      q.clear();
    }
  });
  const Request r = whole(4096, 16);
  for (auto _ : state) {
    {
      std::lock_guard<std::mutex> lock(mu);
      q.push_back(r);
    }
    cv.notify_one();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_one();
  t.join();
}

BENCHMARK(BM_BaselineHandOff)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StartLoadSilentPeer)->Unit(benchmark::kMicrosecond)->Iterations(2000);
BENCHMARK(BM_StartLoadConnected)->Unit(benchmark::kMicrosecond)->Iterations(200);
BENCHMARK(BM_ReadGrants)->Unit(benchmark::kMillisecond)->Iterations(5);
BENCHMARK_CAPTURE(BM_LoadHostCost, llama3_70b_128k / P_TP8 / D_TP8 / shuffled, 8)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(42);
BENCHMARK_CAPTURE(BM_LoadHostCost, llama3_70b_128k / P_TP8 / D_TP2 / shuffled, 2)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(22);
BENCHMARK_CAPTURE(BM_LoadHostCost, llama3_70b_128k / P_TP8 / D_TP8 / shuffled / streamed, 8, true)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(22);
BENCHMARK_CAPTURE(BM_PushHostCost, llama3_70b_128k / P_TP8 / D_TP8 / shuffled, false)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(12);
BENCHMARK_CAPTURE(BM_PushHostCost, llama3_70b_128k / P_TP8 / D_TP8 / shuffled / streamed, true)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(12);

}  // namespace
}  // namespace kvbridge

BENCHMARK_MAIN();

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
#include <arpa/inet.h>
#include <benchmark/benchmark.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/connector.h"
#include "kvbridge/presets.h"

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

}  // namespace
}  // namespace kvbridge

BENCHMARK_MAIN();

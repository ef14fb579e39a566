// connector/worker_test_util.h: ConnectorWorker ranks in one process for
// the worker's tests: each rank with its own engine over the local transport
// (wrapped in a fault transport when a test needs a slow link), llama3-8b
// layouts, and helpers to check what landed.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "device/device.h"
#include "engine/engine_impl.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "testing/engine_faults.h"
#include "transport/fault/fault.h"

namespace kvbridge::worker_test {

using namespace std::chrono_literals;

struct Rank {
  Layout layout;
  std::vector<std::vector<uint8_t>> mem;
  std::vector<std::span<uint8_t>> spans;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ConnectorWorker> worker;
  std::vector<void*> device;  // device memory (fake), freed with the rank
  ~Rank() {
    worker.reset();
    engine.reset();
    for (void* p : device) (void)device::current().free(p);
  }
};

struct InstanceOptions {
  std::string id;
  uint32_t tp = 1;
  uint64_t block_tokens = 16;
  WorkerOptions worker;
  std::shared_ptr<transport::Faults> faults;  // wraps the local transport when set
  uint64_t inline_bytes = EngineOptions{}.inline_bytes;
  bool device = false;              // tensors in device memory (cuda:0 of the host fake: KVB_DEVICE=fake)
  std::string engine_faults;        // testing::create_engine_with_faults's spec (host memory only)
  std::string transport = "local";  // or "tcp" (no faults)
};

inline InstanceOptions opts(std::string id, uint32_t tp) {
  InstanceOptions o;
  o.id = std::move(id);
  o.tp = tp;
  return o;
}

inline std::vector<std::unique_ptr<Rank>> instance(const InstanceOptions& o) {
  std::vector<std::unique_ptr<Rank>> ranks;
  for (uint32_t r = 0; r < o.tp; ++r) {
    auto rank = std::make_unique<Rank>();
    PresetOptions p;
    p.name = "llama3-8b";
    p.tp_size = o.tp;
    p.tp_rank = r;
    p.block_tokens = o.block_tokens;
    p.num_blocks = 8;
    rank->layout = *make_preset(p);
    if (o.device) {
      for (Tensor& t : rank->layout.tensors) {
        Result<void*> p = device::current().allocate(0, t.bytes);
        EXPECT_TRUE(p.ok()) << p.error().to_string();
        std::memset(*p, 0xa5, t.bytes);  // the fake's device memory is mapped in this process
        rank->device.push_back(*p);
        rank->spans.emplace_back(static_cast<uint8_t*>(*p), t.bytes);
        t.memory = "cuda:0";
      }
    } else {
      for (const Tensor& t : rank->layout.tensors) rank->mem.emplace_back(t.bytes, 0xa5);
      for (auto& m : rank->mem) rank->spans.emplace_back(m);
    }
    EngineOptions e;
    e.name = o.id + "/r" + std::to_string(r);
    e.transports = {o.transport};
    e.default_timeout = 2s;
    e.inline_bytes = o.inline_bytes;
    e.secret = o.worker.secret;  // one trust for the side channel and the engine
    std::vector<std::unique_ptr<transport::Transport>> ts;
    std::unique_ptr<transport::Transport> local = o.transport == "tcp"
                                                      ? *transport::make_tcp_transport("127.0.0.1", 2, e.secret)
                                                      : *transport::make_local_transport();
    ts.push_back(o.faults ? transport::make_fault_transport(std::move(local), o.faults) : std::move(local));
    Result<std::unique_ptr<Engine>> engine = o.engine_faults.empty()
                                                 ? engine_internal::create_engine(e, std::move(ts))
                                                 : testing::create_engine_with_faults(e, o.engine_faults);
    EXPECT_TRUE(engine.ok()) << engine.error().to_string();
    rank->engine = std::move(*engine);
    WorkerOptions w = o.worker;
    w.instance_id = o.id;
    Result<std::unique_ptr<ConnectorWorker>> worker =
        ConnectorWorker::create(*rank->engine, rank->layout, rank->spans, w);
    EXPECT_TRUE(worker.ok()) << worker.error().to_string();
    rank->worker = std::move(*worker);
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

inline std::vector<std::string> addresses(const std::vector<std::unique_ptr<Rank>>& ranks) {
  std::vector<std::string> out;
  for (const auto& r : ranks) out.push_back(r->worker->side_channel_address());
  return out;
}

// 40 tokens: prefill blocks {4,5,6} of 16 tokens, decode blocks {1,2,3}.
inline Request request(uint64_t skip = 0) {
  Request q;
  q.num_tokens = 40;
  q.skip_tokens = skip;
  q.blocks["full"] = {{1, 2, 3}, {4, 5, 6}};
  return q;
}

inline LoadResult wait_one(ConnectorWorker& w) {
  for (int i = 0; i < 500; ++i) {
    std::vector<LoadResult> r = w.take_results();
    if (!r.empty()) return r.front();
    w.wait_results(10ms);
  }
  ADD_FAILURE() << "no load result within 5 s";
  return {};
}

// Bad cells of `layers` (none named: every layer) of the request at the
// decode rank (0: all arrived).
inline uint64_t bad_cells(const Rank& r, const Request& q, const std::set<std::string, std::less<>>& layers,
                          uint64_t seed) {
  Result<ContentReport> c = check_request(layers.empty() ? r.layout : keep_layers(r.layout, layers), q,
                                          RequestSide::kLocal, q.skip_tokens, seed, r.spans);
  EXPECT_TRUE(c.ok()) << c.error().to_string();
  return c.ok() ? c->bad_cells : ~uint64_t{0};
}

inline uint64_t cells(const Rank& r, const Request& q, const std::set<std::string, std::less<>>& layers) {
  Result<ContentReport> c = check_request(layers.empty() ? r.layout : keep_layers(r.layout, layers), q,
                                          RequestSide::kLocal, q.skip_tokens, 1, r.spans);
  return c.ok() ? c->cells : 0;
}

}  // namespace kvbridge::worker_test

// Test-only helpers for the store tests: rank memory for a preset layout,
// requests with consecutive block ids, tokens, content checks that skip
// the groups the store never keeps, and every rank of an instance on one
// Store (Instance).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "device/device.h"
#include "kvbridge/content.h"
#include "kvbridge/host_memory.h"
#include "kvbridge/presets.h"
#include "kvbridge/store.h"
#include "store/canonical.h"

namespace kvbridge::testing {

// Zero at start without a pass over it (HostMemory maps it): a request
// touches a few blocks of tensors of hundreds of MiB (qwen3-next's states),
// and zeroing them all took most of a store test's time.
struct RankMemory {
  Layout layout;
  std::vector<HostMemory> bytes;
  std::vector<std::span<uint8_t>> spans;
  explicit RankMemory(Layout l) : layout(std::move(l)) {
    for (const Tensor& t : layout.tensors) {
      Result<HostMemory> m = HostMemory::allocate(t.bytes);
      EXPECT_TRUE(m.ok()) << m.status().to_string();
      bytes.push_back(m.ok() ? std::move(*m) : HostMemory());
      spans.push_back(bytes.back().span());
    }
  }
  TensorMemory memory() { return TensorMemory(spans); }
};

inline Layout preset(const std::string& name, uint32_t tp, uint32_t rank, uint64_t block_tokens, uint64_t num_blocks,
                     Order order = Order::kLBHNC) {
  PresetOptions o;
  o.name = name;
  o.tp_size = tp;
  o.tp_rank = rank;
  o.block_tokens = block_tokens;
  o.num_blocks = num_blocks;
  o.order = order;
  Result<Layout> l = make_preset(o);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return l.ok() ? *l : Layout{};
}

// Every group's list covers num_tokens (one block for scratch) with
// consecutive ids from `first` + (group index) * `stride`; a stride keeps
// groups that overlay one tensor (gpt-oss, glm5-flash) off each other's blocks.
inline Request make_request(const Layout& l, uint64_t num_tokens, int64_t first = 0, int64_t stride = 0) {
  Request r;
  r.num_tokens = num_tokens;
  for (size_t gi = 0; gi < l.groups.size(); ++gi) {
    const Group& g = l.groups[gi];
    if (!g.transfer) continue;
    const int64_t base = first + static_cast<int64_t>(gi) * stride;
    GroupBlocks& b = r.blocks[g.name];
    const uint64_t n = g.kind == GroupKind::kScratch ? 1 : (num_tokens + g.block_tokens - 1) / g.block_tokens;
    for (uint64_t i = 0; i < n; ++i) b.local.push_back(base + static_cast<int64_t>(i));
    b.remote = b.local;
  }
  return r;
}

// The layout with only the groups the store keeps transferable: what a get
// writes, for check_request.
inline Layout stored_view(Layout l) {
  for (Group& g : l.groups) g.transfer = store_internal::is_stored(g);
  return l;
}

inline std::vector<uint32_t> tokens(uint64_t seed, uint64_t n) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = static_cast<uint32_t>(rng() % 150000);
  return t;
}

struct Geometry {
  uint32_t tp;
  uint64_t block_tokens;
  Order order = Order::kLBHNC;
};

// All ranks of one instance, on one Store.
struct Instance {
  std::vector<RankMemory> ranks;
  std::vector<RankStore> stores;
  int64_t stride = 0;  // block ids per group when groups overlay tensors
  // Room for requests of up to max_tokens from block 2.
  Instance(const std::shared_ptr<Store>& store, const std::string& name, Geometry g, uint64_t max_tokens) {
    const uint64_t per_group = (max_tokens + g.block_tokens - 1) / g.block_tokens;
    const Layout probe = preset(name, g.tp, 0, g.block_tokens, 1, g.order);
    uint64_t num_blocks = 2 + per_group;
    if (has_overlay(probe)) {
      stride = static_cast<int64_t>(per_group);
      num_blocks = 2 + per_group * probe.groups.size();
    }
    for (uint32_t r = 0; r < g.tp; ++r) {
      ranks.emplace_back(preset(name, g.tp, r, g.block_tokens, num_blocks, g.order));
      Result<RankStore> s = RankStore::create(store, ranks.back().layout);
      EXPECT_TRUE(s.ok()) << s.status().to_string();
      stores.push_back(std::move(*s));
    }
  }
  // The pattern of a request of n tokens from block `first`, with the states
  // an align-mode engine keeps at its earlier block boundaries.
  void fill(uint64_t n, uint64_t seed, int64_t first = 0) {
    for (RankMemory& m : ranks) {
      for (const Group& g : m.layout.groups) {
        if (g.kind != GroupKind::kState) continue;
        for (uint64_t t = g.block_tokens; t < n; t += g.block_tokens) {
          ASSERT_TRUE(
              fill_request(m.layout, make_request(m.layout, t, first, stride), RequestSide::kLocal, 0, seed, m.memory())
                  .ok());
        }
      }
      ASSERT_TRUE(
          fill_request(m.layout, make_request(m.layout, n, first, stride), RequestSide::kLocal, 0, seed, m.memory())
              .ok());
    }
  }
  uint64_t put(const std::vector<uint32_t>& t, uint64_t n, size_t only_rank = SIZE_MAX, int64_t first = 0) {
    uint64_t bytes = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (only_rank != SIZE_MAX && r != only_rank) continue;
      Result<PutResult> p = stores[r].put(t, make_request(ranks[r].layout, n, first, stride), ranks[r].memory());
      EXPECT_TRUE(p.ok()) << p.status().to_string();
      if (p.ok()) bytes += p->bytes_copied;
    }
    return bytes;
  }
  // Gets n tokens on every rank (from block `first`) and checks the hit.
  void get_and_check(const std::vector<uint32_t>& t, uint64_t n, uint64_t seed, uint64_t expect_hit,
                     int64_t first = 2) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      RankMemory& m = ranks[r];
      Result<GetResult> g = stores[r].get(t, make_request(m.layout, n, first, stride), m.memory());
      ASSERT_TRUE(g.ok()) << g.status().to_string();
      EXPECT_EQ(g->hit_tokens, expect_hit) << "rank " << r;
      if (g->hit_tokens == 0) continue;
      Result<ContentReport> c =
          check_request(stored_view(m.layout), make_request(m.layout, g->hit_tokens, first, stride),
                        RequestSide::kLocal, 0, seed, m.memory());
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      EXPECT_GT(c->cells, 0u);
      EXPECT_EQ(c->bad_cells, 0u) << "rank " << r << ": " << c->first_error;
    }
  }
};

// One rank's tensors in device memory (the process's device: the fake in
// the tests), with a host mirror that requests are filled and checked in.
struct DeviceRank {
  RankMemory host;
  std::vector<void*> device;
  std::vector<std::span<uint8_t>> spans;
  device::Stream stream = nullptr;
  device::Event event = nullptr;
  explicit DeviceRank(Layout l) : host(std::move(l)) {
    device::Device& d = device::current();
    for (const Tensor& t : host.layout.tensors) {
      Result<void*> p = d.allocate(0, t.bytes);
      EXPECT_TRUE(p.ok()) << p.status().to_string();
      device.push_back(p.ok() ? *p : nullptr);
      spans.emplace_back(static_cast<uint8_t*>(device.back()), p.ok() ? t.bytes : 0);
    }
    Result<device::Stream> made_stream = d.create_stream(0);
    Result<device::Event> made_event = d.create_event(0, false);
    EXPECT_TRUE(made_stream.ok() && made_event.ok());
    if (made_stream.ok()) stream = *made_stream;
    if (made_event.ok()) event = *made_event;
  }
  ~DeviceRank() {
    device::Device& d = device::current();
    await();  // nothing queued outlives the memory
    d.destroy_event(event);
    d.destroy_stream(stream);
    for (void* p : device) (void)d.free(p);
  }
  DeviceRank(const DeviceRank&) = delete;
  DeviceRank& operator=(const DeviceRank&) = delete;
  const Layout& layout() const { return host.layout; }
  TensorMemory memory() { return TensorMemory(spans); }
  // A slow producer: the mirror's bytes land on the device after `delay`
  // (queued behind a kernel that takes that long); returns the event
  // recorded after them, as a Readiness.
  Readiness upload(std::chrono::microseconds delay) {
    device::Device& d = device::current();
    EXPECT_TRUE(d.fill_after(stream, device[0], 1, 0, delay).ok());
    std::vector<device::DeviceCopy> copies;
    for (size_t t = 0; t < device.size(); ++t) copies.push_back({device[t], host.bytes[t].data(), spans[t].size()});
    EXPECT_TRUE(d.copy(stream, copies, device::CopyMethod::kCopyEngine).ok());
    EXPECT_TRUE(d.record(event, stream).ok());
    Readiness r;
    r.event = reinterpret_cast<uintptr_t>(event);
    return r;
  }
  void await() {
    for (Result<bool> done = device::current().done(event); done.ok() && !*done; done = device::current().done(event))
      std::this_thread::yield();
  }
  // The device memory back into the mirror (after the producer finished).
  void download() {
    device::Device& d = device::current();
    await();
    for (size_t t = 0; t < device.size(); ++t) {
      EXPECT_TRUE(d.copy_sync(host.bytes[t].data(), device[t], spans[t].size()).ok());
    }
  }
};

inline std::shared_ptr<Store> memory_store(uint64_t H, uint64_t bytes = uint64_t{1} << 30) {
  StoreOptions o;
  o.hash_block_tokens = H;
  o.memory_bytes = bytes;
  return *Store::create(o);
}

// Device memory into the store: an instance of `name` at `w.tp` ranks with
// `w.block_tokens`-token blocks puts n tokens (tokens(seed, n)) from device
// memory while its producer is still writing them: the put waits for the
// producer's event.
inline void device_put(const std::shared_ptr<Store>& store, const std::string& name, Geometry w, uint64_t n,
                       uint64_t seed, const RankStoreOptions& options = RankStoreOptions{"cuda:0"}) {
  using namespace std::chrono_literals;
  const std::vector<uint32_t> t = tokens(seed, n);
  for (uint32_t rank = 0; rank < w.tp; ++rank) {
    DeviceRank m(preset(name, w.tp, rank, w.block_tokens, n / w.block_tokens + 4, w.order));
    Result<RankStore> rs = RankStore::create(store, m.layout(), options);
    ASSERT_TRUE(rs.ok()) << rs.status().to_string();
    ASSERT_TRUE(
        fill_request(m.layout(), make_request(m.layout(), n), RequestSide::kLocal, 0, seed, m.host.memory()).ok());
    const Readiness ready = m.upload(20ms);
    Result<PutResult> p = rs->put(t, make_request(m.layout(), n), m.memory(), ready);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_GT(p->bytes_copied, 0u) << "rank " << rank;
  }
}

// Device memory out of the store: an instance at `r` gets what device_put()
// put into device memory while the blocks' previous owner still writes them
// (the get waits for that), byte for byte. Returns the smallest hit of its
// ranks (0 on a failure, which it reports).
inline uint64_t device_get(const std::shared_ptr<Store>& store, const std::string& name, Geometry r, uint64_t n,
                           uint64_t seed, const RankStoreOptions& options = RankStoreOptions{"cuda:0"}) {
  using namespace std::chrono_literals;
  const std::vector<uint32_t> t = tokens(seed, n);
  uint64_t hit = UINT64_MAX;
  for (uint32_t rank = 0; rank < r.tp; ++rank) {
    DeviceRank m(preset(name, r.tp, rank, r.block_tokens, n / r.block_tokens + 4, r.order));
    Result<RankStore> rs = RankStore::create(store, m.layout(), options);
    EXPECT_TRUE(rs.ok()) << rs.status().to_string();
    if (!rs.ok()) return 0;
    const Readiness previous_owner = m.upload(20ms);  // zeros, landing late
    Result<GetResult> g = rs->get(t, make_request(m.layout(), n, 1), m.memory(), previous_owner);
    EXPECT_TRUE(g.ok()) << g.status().to_string();
    if (!g.ok()) return 0;
    hit = std::min(hit, g->hit_tokens);
    if (g->hit_tokens == 0) continue;
    m.download();
    Result<ContentReport> c = check_request(stored_view(m.layout()), make_request(m.layout(), g->hit_tokens, 1),
                                            RequestSide::kLocal, 0, seed, m.host.memory());
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    if (!c.ok()) return 0;
    EXPECT_GT(c->cells, 0u);
    EXPECT_EQ(c->bad_cells, 0u) << "rank " << rank << ": " << c->first_error;
    if (c->bad_cells != 0) return 0;
  }
  return hit;
}

// device_put() through `writer`, then device_get() through `reader`.
inline uint64_t device_round_trip(const std::shared_ptr<Store>& writer, const std::shared_ptr<Store>& reader,
                                  const std::string& name, Geometry w, Geometry r, uint64_t n, uint64_t seed,
                                  const RankStoreOptions& options = RankStoreOptions{"cuda:0"}) {
  device_put(writer, name, w, n, seed, options);
  return device_get(reader, name, r, n, seed, options);
}

}  // namespace kvbridge::testing

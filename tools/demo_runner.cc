// What a demo rank plays of an engine's model runner (demo_runner.h).
#include "demo_runner.h"

#include <cstring>
#include <thread>
#include <utility>

namespace kvbridge::cli::demo {

Result<RankMemory> RankMemory::allocate(const Layout& layout, std::optional<uint8_t> sentinel) {
  RankMemory m;
  for (const Tensor& t : layout.tensors) {
    Result<HostMemory> got = HostMemory::allocate(t.bytes);
    if (!got.ok()) return got.error().with_context("tensor '" + t.name + "'");
    m.memory_.push_back(std::move(got).value());
    HostMemory& h = m.memory_.back();
    // Populated first: the sentinel's memset then faults no page.
    if (sentinel) {
      KVB_RETURN_IF_ERROR(h.populate());
      std::memset(h.data(), *sentinel, t.bytes);
    }
    m.spans_.emplace_back(h.data(), t.bytes);
  }
  m.host_ = m.spans_;
  return m;
}

Status RankMemory::to_device(Layout& layout, uint32_t rank) {
  device::Device& d = device::current();
  KVB_ASSIGN_OR_RETURN(int n, d.count());
  gpu_ = static_cast<int>(rank % static_cast<uint32_t>(n));
  KVB_ASSIGN_OR_RETURN(stream_, d.create_stream(gpu_));
  KVB_ASSIGN_OR_RETURN(event_, d.create_event(gpu_, false));
  // A streamed layer's KV is written on stream_ and announced at once: its
  // readers wait on the layer's event on their device, not the prefill on
  // its host. One interprocess event per layer, recorded again by each
  // request (a reader waits for its latest record).
  for (size_t l = 0; l < layer_order(layout).size(); ++l) {
    KVB_ASSIGN_OR_RETURN(device::Event e, d.create_event(gpu_, true));
    KVB_ASSIGN_OR_RETURN(std::string handle, d.export_event(e));
    layer_events_.push_back(e);
    layer_handles_.push_back(std::move(handle));
  }
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    KVB_ASSIGN_OR_RETURN(void* p, d.allocate(gpu_, host_[t].size()));
    KVB_RETURN_IF_ERROR(d.copy_sync(p, host_[t].data(), host_[t].size()));
    spans_[t] = std::span<uint8_t>(static_cast<uint8_t*>(p), host_[t].size());
    layout.tensors[t].memory = "cuda:" + std::to_string(gpu_);
  }
  device_ = true;
  return Status();
}

Status RankMemory::sync(const Layout& layout, const Request& q, RequestSide side, uint64_t first_token, bool to_device,
                        bool queue_only) {
  if (!device_) return Status();
  std::vector<device::DeviceCopy> copies;
  KVB_RETURN_IF_ERROR(for_each_cell(layout, q, side, first_token, [&](size_t t, uint64_t off, uint64_t n, uint64_t) {
    uint8_t* h = host_[t].data() + off;
    uint8_t* d = spans_[t].data() + off;
    device::DeviceCopy c = to_device ? device::DeviceCopy{d, h, n} : device::DeviceCopy{h, d, n};
    device::DeviceCopy* last = copies.empty() ? nullptr : &copies.back();
    if (last != nullptr && static_cast<uint8_t*>(last->dst) + last->bytes == c.dst &&
        static_cast<const uint8_t*>(last->src) + last->bytes == c.src) {
      last->bytes += n;
    } else {
      copies.push_back(c);
    }
  }));
  if (copies.empty()) return Status();
  device::Device& d = device::current();
  KVB_RETURN_IF_ERROR(d.copy(stream_, copies, device::CopyMethod::kCopyEngine));
  if (queue_only) return Status();
  KVB_RETURN_IF_ERROR(d.record(event_, stream_));
  for (;;) {
    KVB_ASSIGN_OR_RETURN(bool done, d.done(event_));
    if (done) return Status();
    std::this_thread::yield();
  }
}

Status RankMemory::pull(size_t t) {
  if (!device_) return Status();
  return device::current().copy_sync(host_[t].data(), spans_[t].data(), spans_[t].size());
}

Status RankMemory::make_resident(const Layout& layout, const Request& q) {
  std::vector<std::pair<uint64_t, uint64_t>> open(memory_.size(), {0, 0});  // [begin, end) per tensor
  Status s;
  auto flush = [&](size_t t) {
    if (s.ok() && open[t].second > open[t].first)
      s = memory_[t].populate(open[t].first, open[t].second - open[t].first);
    open[t] = {0, 0};
  };
  KVB_RETURN_IF_ERROR(
      for_each_cell(layout, q, RequestSide::kRemote, 0, [&](size_t t, uint64_t off, uint64_t n, uint64_t) {
        if (open[t].second != off) flush(t);
        if (open[t].second == 0) open[t].first = off;
        open[t].second = off + n;
      }));
  for (size_t t = 0; t < open.size(); ++t) flush(t);
  return s;
}

void busy_until(std::chrono::steady_clock::time_point until) {
  using Clock = std::chrono::steady_clock;
  if (Clock::now() >= until) return;
  float m[16][16], v[16], out[16];
  for (int i = 0; i < 16; ++i) {
    v[i] = 1.0f / static_cast<float>(i + 1);
    for (int j = 0; j < 16; ++j) m[i][j] = static_cast<float>((i * 16 + j) % 7) * 0.01f;
  }
  while (Clock::now() < until) {
    for (int i = 0; i < 16; ++i) {
      float acc = 0;
      for (int j = 0; j < 16; ++j) acc += m[i][j] * v[j];
      out[i] = acc;
    }
    for (int i = 0; i < 16; ++i) v[i] = out[i] * 0.5f + 0.01f;
  }
  volatile float sink = v[0];
  (void)sink;
}

}  // namespace kvbridge::cli::demo

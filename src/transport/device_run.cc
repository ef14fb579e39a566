// Device copies under the Link contract (device_run.h).
#include "transport/device_run.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace kvbridge::transport {
namespace {

// Cuts `copies` into batches of at most `slice` bytes, cutting a copy where
// a batch fills.
std::vector<std::vector<device::DeviceCopy>> batches_of(std::span<const device::DeviceCopy> copies, uint64_t slice) {
  std::vector<std::vector<device::DeviceCopy>> out(1);
  uint64_t room = slice;
  for (device::DeviceCopy c : copies) {
    while (c.bytes > 0) {
      if (room == 0) {
        out.emplace_back();
        room = slice;
      }
      const uint64_t n = std::min(room, c.bytes);
      out.back().push_back({c.dst, c.src, n});
      c.dst = static_cast<uint8_t*>(c.dst) + n;
      c.src = static_cast<const uint8_t*>(c.src) + n;
      c.bytes -= n;
      room -= n;
    }
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

}  // namespace

// Spinning first because a small copy's completion lands within 50 us; a
// sleep is never shorter than the kernel's timer slack (~50 us), so
// sleeping at once would put that on every small transfer.
Status await_event(device::Device& device, device::Event event, const std::function<bool()>& give_up) {
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  auto pause = std::chrono::microseconds(10);
  for (;;) {
    KVB_ASSIGN_OR_RETURN(bool done, device.done(event));
    if (done) return Status();
    if (give_up && give_up()) return Status::cancelled("");
    if (std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(100));
    }
  }
}

Result<DeviceRunOptions> device_run_options(const DeviceCopyConfig& config) {
  DeviceRunOptions o;
  KVB_ASSIGN_OR_RETURN(o.method, device::parse_copy_method(config.method));
  o.max_blocks = config.max_blocks;
  o.kernel_below = config.kernel_below;
  o.kernel_min = config.kernel_min;
  return o;
}

device::CopyMethod choose_method(const DeviceRunOptions& options, std::span<const device::DeviceCopy> copies) {
  if (options.method != device::CopyMethod::kAuto) return options.method;
  uint64_t total = 0, count = 0;
  for (const device::DeviceCopy& c : copies) {
    total += c.bytes;
    count += c.bytes > 0;
  }
  const bool small = count > 0 && count >= options.kernel_min && total / count <= options.kernel_below;
  return small ? device::CopyMethod::kKernel : device::CopyMethod::kCopyEngine;
}

StreamPool::~StreamPool() {
  for (Slot* s : all_) {
    for (device::Event e : s->events) {
      if (e != nullptr) device_.destroy_event(e);
    }
    if (s->stream != nullptr) device_.destroy_stream(s->stream);
    delete s;
  }
}

Result<StreamPool::Slot*> StreamPool::acquire(int device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(device);
    if (it != idle_.end()) {
      Slot* s = it->second;
      idle_.erase(it);
      return s;
    }
  }
  auto s = std::make_unique<Slot>();
  s->device = device;
  KVB_ASSIGN_OR_RETURN(s->stream, device_.create_stream(device));
  for (device::Event& e : s->events) {
    Result<device::Event> made = device_.create_event(device, false);
    if (!made.ok()) {
      for (device::Event& f : s->events) {
        if (f != nullptr) device_.destroy_event(f);
      }
      device_.destroy_stream(s->stream);
      return made.error();
    }
    e = *made;
  }
  std::lock_guard<std::mutex> lock(mu_);
  all_.push_back(s.get());
  return s.release();
}

void StreamPool::release(Slot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_.emplace(slot->device, slot);
}

void ReadyEvents::forget(uint64_t owner) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(opened_, [owner](const auto& e) { return e.first.first == owner; });
}

size_t ReadyEvents::cached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opened_.size();
}

Result<std::vector<std::shared_ptr<void>>> ReadyEvents::resolve(const RunControl& control, uint64_t owner) {
  std::vector<std::shared_ptr<void>> out;
  // This process's own event: the caller's, never closed here.
  if (control.ready_event != 0) out.emplace_back(reinterpret_cast<void*>(control.ready_event), [](void*) {});
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& h : control.ready_events) {
    auto it = opened_.find({owner, h});
    if (it == opened_.end()) {
      Result<device::Event> e = device_.open_event(h);
      if (!e.ok()) return e.error().with_context("opening a ready event");
      if (opened_.size() >= kMaxOpened) {
        auto oldest = std::min_element(opened_.begin(), opened_.end(),
                                       [](const auto& a, const auto& b) { return a.second.second < b.second.second; });
        opened_.erase(oldest);
      }
      device::Device* d = &device_;
      std::shared_ptr<void> event(*e, [d](void* p) { d->destroy_event(p); });
      it = opened_.emplace(std::make_pair(owner, h), std::make_pair(std::move(event), uint64_t{0})).first;
    }
    it->second.second = ++tick_;
    out.push_back(it->second.first);
  }
  return out;
}

void DeviceSide::add_local(uint32_t segment, const uint8_t* base, uint64_t bytes, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  local_[reinterpret_cast<uintptr_t>(base)] = {bytes, device};
  ids_[segment] = reinterpret_cast<uintptr_t>(base);
  locals_.store(ids_.size(), std::memory_order_release);
}

void DeviceSide::remove_local(uint32_t segment) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ids_.find(segment);
  if (it == ids_.end()) return;
  local_.erase(it->second);
  ids_.erase(it);
  locals_.store(ids_.size(), std::memory_order_release);
}

bool DeviceSide::has_local_segment(uint32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return ids_.count(id) > 0;
}

bool DeviceSide::peer_access(int device, int peer) {
  if (device == peer) return true;
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, fresh] = peers_.emplace(std::make_pair(device, peer), false);
  if (fresh) it->second = device_.enable_peer_access(device, peer).ok();
  return it->second;
}

int DeviceSide::local_device(const uint8_t* p) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = local_.upper_bound(at);
  if (it == local_.begin()) return -1;
  --it;
  return at < it->first + it->second.first ? it->second.second : -1;
}

DeviceSide::Span DeviceSide::local_span(const uint8_t* p) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto next = local_.upper_bound(at);  // the first segment after p
  Span span{0, UINTPTR_MAX, -1};
  if (next != local_.begin()) {
    auto it = std::prev(next);
    if (at < it->first + it->second.first) return Span{it->first, it->first + it->second.first, it->second.second};
    span.begin = it->first + it->second.first;
  }
  if (next != local_.end()) span.end = next->first;
  return span;
}

Status run_device_copies(StreamPool& pool, ReadyEvents& ready, int device, std::span<const device::DeviceCopy> copies,
                         const DeviceRunOptions& options, RunControl& control, const std::function<Status()>& alive,
                         const std::string& who, uint64_t owner) {
  device::Device& dev = pool.device();
  // Why the run should stop queueing, if it should.
  auto stop_reason = [&]() -> Status {
    if (control.cancel.load(std::memory_order_acquire)) return Status::cancelled(who + ": run cancelled");
    if (Clock::now() >= control.deadline) return Status::timeout(who + ": run passed its deadline");
    if (alive) return alive();
    return Status();
  };
  KVB_RETURN_IF_ERROR(stop_reason());
  uint64_t total = 0;
  for (const device::DeviceCopy& c : copies) total += c.bytes;
  if (total == 0) return Status();

  // The producer's events, on the host: nothing is queued before they
  // completed, so a cancel or a dead producer leaves nothing behind.
  KVB_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<void>> events, ready.resolve(control, owner));
  Status stopped;
  for (const std::shared_ptr<void>& e : events) {
    Status s = await_event(dev, e.get(), [&] {
      stopped = stop_reason();
      return !stopped.ok();
    });
    if (!stopped.ok()) return stopped;
    KVB_RETURN_IF_ERROR(s.with_context(who + ": waiting for a ready event"));
  }

  KVB_ASSIGN_OR_RETURN(StreamPool::Slot * slot, pool.acquire(device));
  for (const std::shared_ptr<void>& e : events) {
    // Satisfied already (seen above); keeps the stream's order exact.
    if (Status s = dev.wait_event(slot->stream, e.get()); !s.ok()) {
      pool.release(slot);
      return s.with_context(who);
    }
  }
  const device::CopyMethod method = choose_method(options, copies);
  const std::vector<std::vector<device::DeviceCopy>> batches = batches_of(copies, options.slice_bytes);
  // Batch i uses event i % 2; at most two are in flight.
  uint64_t bytes_of[2] = {0, 0};
  size_t launched = 0, landed = 0;
  Status outcome;
  auto land_one = [&]() -> Status {
    const size_t k = landed % 2;
    KVB_RETURN_IF_ERROR(await_event(dev, slot->events[k], nullptr).with_context(who + ": a copy batch"));
    control.bytes_done.fetch_add(bytes_of[k], std::memory_order_release);
    ++landed;
    return Status();
  };
  while (launched < batches.size()) {
    if (launched - landed == 2) {
      outcome = land_one();
      if (!outcome.ok()) break;
    }
    outcome = stop_reason();
    if (!outcome.ok()) break;
    const auto& b = batches[launched];
    outcome = dev.copy(slot->stream, b, method, options.max_blocks);
    if (outcome.ok()) outcome = dev.record(slot->events[launched % 2], slot->stream);
    if (!outcome.ok()) {
      outcome = outcome.with_context(who);
      break;
    }
    uint64_t n = 0;
    for (const device::DeviceCopy& c : b) n += c.bytes;
    bytes_of[launched % 2] = n;
    ++launched;
  }
  // Whatever was queued lands before the run returns.
  while (landed < launched) {
    Status s = land_one();
    if (!s.ok()) {
      if (outcome.ok()) outcome = s;
      break;
    }
  }
  pool.release(slot);
  return outcome;
}

}  // namespace kvbridge::transport

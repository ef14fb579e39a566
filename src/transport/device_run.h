// transport/device_run.h: what the transports that move device memory
// (local, cuda_ipc) share: a pool of copy streams per device, and one run of
// device copies under the Link contract of transport.h.
//
// A run waits for the caller's ready events first, on the host (polling
// them, so that cancel, the deadline and the peer's death are seen while it
// waits, and no copy is queued behind an event that may never complete),
// then queues its copies on a stream of the pool as batches of at most
// `slice_bytes` (one batch, one cudaMemcpyBatchAsync or one kernel, when
// the transfer is smaller), at most two batches in flight, and counts a
// batch's bytes done when its event completes. Cancel, the deadline or the
// peer's death stop it from queueing more, and it returns only when every
// queued batch has completed: a launched copy cannot be recalled, so the
// contract "when run returns, nothing lands" is kept by waiting for it.
//
// Thread-safety: StreamPool and run_device_copies may be used from several
// threads at once; each run takes a stream of its own from the pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "device/device.h"
#include "kvbridge/status.h"
#include "transport/transport.h"

namespace kvbridge::transport {

// How device copies run. kAuto chooses per run (choose_method()): the
// kernel for many small copies (at least `kernel_min` of them, of at most
// `kernel_below` bytes on average), the copy engines otherwise; the
// crossover is the device's, measured by gpu_bench (which prints it), and
// kernel_below 0 (the default until it is measured) leaves every run to
// the copy engines.
struct DeviceRunOptions {
  device::CopyMethod method = device::CopyMethod::kCopyEngine;
  uint32_t max_blocks = 0;                    // the kernel's grid cap (0: default)
  uint64_t slice_bytes = uint64_t{64} << 20;  // bytes per batch
  uint64_t kernel_below = 0;
  uint32_t kernel_min = 64;
};
// From the engine's configuration; kInvalidArgument naming a bad method.
Result<DeviceRunOptions> device_run_options(const DeviceCopyConfig& config);
// The method a run of `copies` uses: options.method unless kAuto.
device::CopyMethod choose_method(const DeviceRunOptions& options, std::span<const device::DeviceCopy> copies);

// Streams (each with three events) per device, created on first use and
// reused; destroyed with the pool.
class StreamPool {
 public:
  explicit StreamPool(device::Device& device) : device_(device) {}
  ~StreamPool();
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;

  struct Slot {
    int device = 0;
    device::Stream stream = nullptr;
    device::Event events[3] = {nullptr, nullptr, nullptr};
  };
  Result<Slot*> acquire(int device);
  void release(Slot* slot);
  device::Device& device() { return device_; }

 private:
  device::Device& device_;
  std::mutex mu_;
  std::vector<Slot*> all_;
  std::multimap<int, Slot*> idle_;
};

// Events a run waits for before its first copy ("this KV is ready after
// this"): opened from IPC handles, or this process's own. Opened handles are
// cached per owner (the peer whose run brought them, which exported them),
// the most recent kMaxOpened of them (a producer that makes an event per
// request would otherwise grow the cache without bound), and released with
// their owner (forget(): a peer that exited destroyed its events, whose
// handles must not be used again); each run holds what it resolved, so an
// event evicted or forgotten while a run waits on it stays open until that
// run returns.
class ReadyEvents {
 public:
  static constexpr size_t kMaxOpened = 256;
  explicit ReadyEvents(device::Device& device) : device_(device) {}
  // The events of `control` (RunControl::ready_events and ready_event),
  // held until the returned vector goes; handles opened for `owner`.
  Result<std::vector<std::shared_ptr<void>>> resolve(const RunControl& control, uint64_t owner = 0);
  // Closes the cached events of `owner` (once no run holds them).
  void forget(uint64_t owner);
  size_t cached() const;

 private:
  device::Device& device_;
  mutable std::mutex mu_;
  uint64_t tick_ = 0;
  // (owner, handle) -> (event, last use)
  std::map<std::pair<uint64_t, std::string>, std::pair<std::shared_ptr<void>, uint64_t>> opened_;
};

// What a transport that moves device memory keeps for its links: the
// streams, the opened ready events, and which local segments are device
// memory (add_segment/remove_segment keep it). Outlives the links.
class DeviceSide {
 public:
  explicit DeviceSide(device::Device& device) : device_(device), pool_(device), ready_(device) {}
  device::Device& device() { return device_; }
  StreamPool& pool() { return pool_; }
  ReadyEvents& ready() { return ready_; }
  void add_local(uint32_t segment, const uint8_t* base, uint64_t bytes, int device);
  void remove_local(uint32_t segment);
  // The device of local pointer `p`, or -1 when it is in no local device
  // segment (host memory).
  int local_device(const uint8_t* p) const;
  // The widest range [begin, end) around `p` whose bytes are all of one
  // device (a device segment), or all in none (the gap between two):
  // callers that classify many pointers look up only those outside the
  // last span.
  struct Span {
    uintptr_t begin = 0, end = 0;
    int device = -1;
    bool contains(const uint8_t* p) const {
      const auto at = reinterpret_cast<uintptr_t>(p);
      return at >= begin && at < end;
    }
  };
  Span local_span(const uint8_t* p) const;
  // Whether local segment `id` is one of these device segments.
  bool has_local_segment(uint32_t id) const;
  // Whether any local segment is device memory (no lock).
  bool has_local() const { return locals_.load(std::memory_order_acquire) > 0; }
  // Whether kernels and copies on `device` reach `peer`'s memory directly:
  // peer access enabled once per pair, the answer kept.
  bool peer_access(int device, int peer);

 private:
  std::atomic<size_t> locals_{0};
  device::Device& device_;
  StreamPool pool_;
  ReadyEvents ready_;
  mutable std::mutex mu_;
  std::map<uintptr_t, std::pair<uint64_t, int>> local_;  // base -> (bytes, device)
  std::map<uint32_t, uintptr_t> ids_;                    // segment id -> base
  std::map<std::pair<int, int>, bool> peers_;            // (device, peer) -> access enabled
};

// Polls `event` on the host until it completed (spinning for the first
// 50 us, then sleeping in steps growing to 100 us), or until `give_up()`
// (may be empty) says stop: then kCancelled; the device's error otherwise.
Status await_event(device::Device& device, device::Event event, const std::function<bool()>& give_up);

// Runs `copies` on a stream of `pool` for device `device` under the Link
// contract. `alive` is asked between batches and while waiting (OK, or the
// error that ends the run: the peer is gone); `who` names the link in
// errors ("cuda_ipc peer 'x' (pid 7)").
// The ready events' handles are opened for `owner` (ReadyEvents).
Status run_device_copies(StreamPool& pool, ReadyEvents& ready, int device, std::span<const device::DeviceCopy> copies,
                         const DeviceRunOptions& options, RunControl& control, const std::function<Status()>& alive,
                         const std::string& who, uint64_t owner = 0);

}  // namespace kvbridge::transport

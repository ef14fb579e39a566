// device/device.h: the one seam between kvbridge and CUDA.
//
// Everything the project asks of a GPU goes through a Device: what memory a
// pointer is (and which allocation holds it), IPC handles for memory and
// events, streams, events, one batched copy of many descriptors, and a few
// helpers that tests, the demo and the bench need (allocate, fill, copy
// synchronously). Two implementations exist:
//
//  - the real one (cuda_device.cc), over the CUDA runtime linked statically,
//    so a binary built with CUDA starts on a machine without a driver and
//    says so (kUnavailable) when asked for device memory;
//  - a host fake (fake_device.cc) whose "device memory" is shared host
//    memory: each allocation is a memfd that its "IPC handle" names, so two
//    processes open each other's memory as with cudaIpcOpenMemHandle; its
//    streams are threads that run their work in order, its events live in
//    shared memory (so an IPC event handle works across processes too).
//
// The fake keeps the real one's rules where logic above the seam depends on
// them: a handle opens once per device (callers cache what they opened), a
// freed allocation's handle
// no longer opens, copies land only when their stream reaches them, and a
// stream that waits on an event waits for the event's latest record.
//
// Devices as CUDA has them: every call that touches a device makes that
// device current for itself (a stream's, an event's, a mapping's, the
// `device` argument) and leaves the calling thread's current device as it
// found it, so no call makes a context on a device it was not asked about
// (a TP worker of GPU 5 never starts one on GPU 0). A handle opens on the
// importer's device, once per (handle, device). Devices are named across
// processes by UUID (uuid()), since an ordinal depends on each process's
// CUDA_VISIBLE_DEVICES.
//
// The fake fails where CUDA fails: several devices per process
// (KVB_FAKE_DEVICES, default 2; KVB_FAKE_VISIBLE_DEVICES reorders them as
// CUDA_VISIBLE_DEVICES does), an event recorded on another device's stream
// refused, a kernel (the gather/scatter copy, the fill, the content hash)
// that touches memory its device cannot reach (another device's without
// peer access, a mapping opened on another device, pageable host memory)
// refused as CUDA's illegal address would be, and an event never recorded
// refused when asked whether it is done.
//
// current() is the process's device: the fake when the environment says
// KVB_DEVICE=fake (tests, and the demo's CPU-only runs), else the real one.
//
// Thread-safety: every method may be called from any thread. Streams and
// events are opaque handles owned by whoever created or opened them, until
// destroy_stream/destroy_event.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::device {

enum class MemoryType : uint8_t {
  kHost,     // not device memory (pageable or pinned host memory)
  kDevice,   // device memory of `device`
  kManaged,  // unified (managed) memory: refused for registration
};

// What a pointer is, and the allocation that holds it.
struct PointerInfo {
  MemoryType type = MemoryType::kHost;
  int device = -1;    // kDevice, kManaged: the device ordinal
  uint64_t base = 0;  // kDevice: the allocation's first byte and size
  uint64_t bytes = 0;
  // kDevice: whether export_memory() can hand it to another process, and
  // why not (e.g. memory from cuMemCreate, which legacy CUDA IPC cannot
  // export).
  bool exportable = false;
  std::string why_not;
};

// Opaque handles of this process.
using Stream = void*;
using Event = void*;

// One copy of a batch: `bytes` from `src` to `dst`, either of which may be
// device memory (this process's, or another's opened with open_memory) or
// host memory.
struct DeviceCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

// A range of device memory to hash (Device::content_hashes).
struct DeviceRange {
  const void* p = nullptr;
  uint64_t bytes = 0;
};

// How copy() moves a batch: the copy engines (one cudaMemcpyBatchAsync) or
// a gather/scatter kernel over the descriptor array on a capped grid.
// kAuto is the transports' (device_run.h: they choose one of the two per
// run); copy() takes it as kCopyEngine.
enum class CopyMethod : uint8_t { kCopyEngine, kKernel, kAuto };
std::string_view copy_method_name(CopyMethod method);    // "copy_engine", "kernel", "auto"
Result<CopyMethod> parse_copy_method(std::string_view);  // kInvalidArgument naming the value

class Device {
 public:
  virtual ~Device() = default;

  // "cuda" or "fake".
  virtual std::string_view name() const = 0;
  // The number of devices; kUnavailable saying why there are none (no CUDA
  // in this build, no driver, no device).
  virtual Result<int> count() = 0;

  // The device's UUID (16 bytes): the same device has the same UUID in
  // every process of the host, whatever its ordinal there.
  virtual Result<std::string> uuid(int device) = 0;

  // What `p` points into. kUnavailable when the device cannot be asked.
  virtual Result<PointerInfo> pointer_info(const void* p) = 0;

  // An IPC handle (opaque bytes, at most 128) for the allocation whose
  // first byte is `base`. kInvalidArgument when `base` does not start a
  // device allocation, kUnavailable when it cannot be exported (why).
  virtual Result<std::string> export_memory(const void* base) = 0;
  // Maps another process's allocation into this one on `device` (this
  // process's ordinal): kernels on `device` may use the mapping, kernels of
  // other devices may not (pointer_info says the mapping is of `device`).
  // The pointer is the allocation's first byte. A handle opens once per
  // (handle, device): opening it again there while open fails
  // (kAlreadyExists). kNotFound when the allocation is gone (freed, or its
  // process exited), kInvalidArgument for bytes that are not a handle.
  virtual Result<void*> open_memory(std::string_view handle, int device) = 0;
  virtual Status close_memory(void* opened) = 0;

  // A non-blocking stream on `device` (never the legacy default stream:
  // cudaMemcpyBatchAsync cannot run there, and it would serialise with the
  // model's work).
  virtual Result<Stream> create_stream(int device) = 0;
  virtual void destroy_stream(Stream stream) = 0;
  // An event without timing; `interprocess` makes it exportable.
  virtual Result<Event> create_event(int device, bool interprocess) = 0;
  virtual void destroy_event(Event event) = 0;
  // An IPC handle for an interprocess event (opaque, at most 128 bytes).
  virtual Result<std::string> export_event(Event event) = 0;
  // Opens another process's event (or one of this process's, by its
  // handle); destroy_event closes it.
  virtual Result<Event> open_event(std::string_view handle) = 0;
  // Records `event` on `stream`: it completes when the stream's earlier
  // work has.
  virtual Status record(Event event, Stream stream) = 0;
  // Work queued on `stream` after this waits for `event`'s latest record.
  virtual Status wait_event(Stream stream, Event event) = 0;
  // Whether the event's latest record completed. An event never recorded
  // is refused (kInvalidArgument, "never recorded"): CUDA would call it
  // complete, and a copy behind it would read what its producer has not
  // written yet. (CUDA cannot tell of an event opened from another
  // process's handle, nor of one this process did not make here.)
  virtual Result<bool> done(Event event) = 0;
  // Lets kernels on `device` use memory of `peer` (cudaDeviceEnablePeerAccess;
  // enabling twice is no error). kUnavailable when the pair cannot.
  virtual Status enable_peer_access(int device, int peer) = 0;

  // Queues one batch of copies on `stream` (in stream order; copies within
  // the batch in any order, so they must not overlap). `max_blocks` caps the
  // kernel's grid (0: the implementation's default).
  virtual Status copy(Stream stream, std::span<const DeviceCopy> copies, CopyMethod method,
                      uint32_t max_blocks = 0) = 0;

  // Queues one copy per element of `copies` (one cudaMemcpyAsync each), as
  // connectors do without a batched copy: the bench's baseline.
  virtual Status copy_each(Stream stream, std::span<const DeviceCopy> copies) = 0;

  // The content check's hash (common/xxh3.h: XXH3-64 of each 64 KiB leaf,
  // then of the leaves' hashes) of each range, all device memory of
  // `device` (this process's, or another's opened with open_memory),
  // computed on the device (a kernel, one thread per leaf), the leaves'
  // hash on the host; returns once done. The ranges' producers must be done
  // (the caller waited for them). kInvalidArgument naming a range that is
  // not device memory of `device` inside one allocation.
  virtual Status content_hashes(int device, std::span<const DeviceRange> ranges, std::vector<uint64_t>* hashes) = 0;

  // Pins `bytes` of host memory at `p` for copies to and from devices
  // (cudaHostRegister, portable to every device): a copy engine then moves
  // it directly, without staging through the driver's bounce buffers, and
  // a kernel may read and write it. Once per range: a range overlapping one
  // already pinned is refused (kAlreadyExists), as CUDA refuses it.
  virtual Status register_host(void* p, uint64_t bytes) = 0;
  // Unpins what register_host(p, ...) pinned; kInvalidArgument when `p`
  // starts no pinned range.
  virtual Status unregister_host(void* p) = 0;

  // Helpers for tests, the demo and the bench.
  // Device memory of `device` (managed: unified memory, to test refusals).
  virtual Result<void*> allocate(int device, uint64_t bytes, bool managed = false) = 0;
  // Device memory of `device` that legacy CUDA IPC cannot export: mapped
  // from cuMemCreate, as PyTorch's expandable segments make it (tests of its
  // refusal). free() frees it.
  virtual Result<void*> allocate_unexportable(int device, uint64_t bytes) = 0;
  virtual Status free(void* p) = 0;
  // Queues on `stream`: wait about `delay` on the device, then set `bytes`
  // at `p` to `value` (a slow producer kernel, to test ordering).
  virtual Status fill_after(Stream stream, void* p, uint64_t bytes, uint8_t value, std::chrono::microseconds delay) = 0;
  // Copies synchronously between any two of host and device memory.
  virtual Status copy_sync(void* dst, const void* src, uint64_t bytes) = 0;
};

// The process's device (see above); never null. The first call decides.
Device& current();
// Whether this build has the real CUDA implementation.
bool cuda_compiled();
// The fake, whatever KVB_DEVICE says (tests).
Device& fake();
// How many allocations of other processes the fake has open in this one
// (tests: that an importer closes what it opened).
size_t fake_opened_count();

// The ordinal in this process of the device whose uuid() is `uuid`, or -1
// when this process does not see it.
Result<int> ordinal_of(Device& device, std::string_view uuid);
// Whether the fake made a context on `device` in this process (tests:
// nothing touches a device it was not asked about).
bool fake_context_on(int device);
// How many host ranges the fake has pinned (register_host) in this process.
size_t fake_pinned_count();
// Why pointer_info() calls memory not from cudaMalloc unexportable.
extern const char* const kNotLegacyIpcCapable;
// How many batches the fake has copied by its gather/scatter kernel.
size_t fake_kernel_copies();

// "cuda:N" -> N; kInvalidArgument naming the text otherwise.
Result<int> parse_cuda_memory(std::string_view memory);
// That [p, p + bytes) is all device memory of the device `memory` names
// (cuda:N), allocation by allocation. kInvalidArgument naming the first byte
// that is not and what it is (host, managed, another device's memory), or a
// device past the count; kUnavailable without a device (the message says
// why).
Status check_device_range(Device& device, const void* p, uint64_t bytes, std::string_view memory);

}  // namespace kvbridge::device

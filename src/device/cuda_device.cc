// The real implementation of device.h, over the CUDA runtime.
//
// The runtime is linked statically (CMAKE_CUDA_RUNTIME_LIBRARY Static): it
// loads the driver (libcuda.so.1) itself when first called, so a binary
// built with CUDA starts on a machine without a driver, and count() says
// why there is no device. Driver-only queries (an allocation's range,
// whether legacy IPC can export it) are looked up through
// cudaGetDriverEntryPointByVersion, for the same reason: no link-time
// dependency on libcuda.
//
// CUDA's rules this file follows:
//  - cudaIpcGetMemHandle exports an allocation made by cudaMalloc; memory
//    from cuMemCreate (PyTorch's expandable_segments) is not "legacy IPC
//    capable" (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) and is
//    refused, naming the allocator setting that avoids it.
//  - cudaIpcOpenMemHandle maps a whole allocation, once per device context; the
//    mapping is closed with cudaIpcCloseMemHandle.
//  - cudaMemcpyBatchAsync (CUDA 12.8+) cannot run on the legacy default
//    stream: every stream here is cudaStreamNonBlocking.
//  - Every call runs with its device current (DeviceScope) and puts the
//    thread's context back as it found it (the driver's cuCtxGetCurrent and
//    cuCtxSetCurrent: cudaSetDevice back to device 0 would start a context
//    there, ~500 MiB on a GPU the process may never use).
//  - cudaIpcOpenMemHandle maps into the current device's context: a
//    mapping is opened on the device whose kernels will use it.
//  - cudaEventRecord fails for an event and a stream of different
//    devices; cudaEventQuery calls an event never recorded complete, so
//    this file remembers which of its events were recorded.
//  - The kernel path reads its pieces from device memory: each stream has
//    a ring of them (pinned staging and device memory, made with the
//    stream), a region of which a launch takes and an event of its own
//    gives back; a batch the ring has no room for goes to the copy
//    engines, so no copy waits on the host or allocates.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "common/xxh3.h"
#include "device/cuda_internal.h"
#include "device/device.h"
#include "device/gather.h"
#include "device/kernels.h"

namespace kvbridge::device {
namespace {

using namespace cuda_internal;

struct RealStream {
  cudaStream_t stream = nullptr;
  int device = 0;
  std::mutex mu;  // the ring
  PieceRing ring;
};

// What this file knows of an event it made.
struct EventInfo {
  int device = 0;
  bool recorded = false;
};

class CudaDevice final : public Device {
 public:
  std::string_view name() const override { return "cuda"; }

  Result<int> count() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      // Without a driver CUDA says "driver version is insufficient"; say
      // what it means first.
      const bool driver = ::access("/proc/driver/nvidia/version", F_OK) == 0;
      return Status::unavailable(std::string(driver ? "no usable CUDA device here" : "no NVIDIA driver loaded here") +
                                 " (" + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")");
    }
    if (n == 0) return Status::unavailable("no CUDA device here (the driver reports none)");
    return n;
  }

  Result<std::string> uuid(int device) override {
    KVB_RETURN_IF_ERROR(ready());
    cudaDeviceProp prop{};
    KVB_CUDA_TRY(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties(" + std::to_string(device) + ")");
    return std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
  }

  Result<PointerInfo> pointer_info(const void* p) override {
    KVB_RETURN_IF_ERROR(ready());
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    PointerInfo info;
    if (e == cudaErrorInvalidValue) {
      (void)cudaGetLastError();
      return info;  // memory CUDA does not know: host
    }
    KVB_CUDA_TRY(e, "cudaPointerGetAttributes");
    if (a.type == cudaMemoryTypeManaged) {
      info.type = MemoryType::kManaged;
      info.device = a.device;
      return info;
    }
    if (a.type != cudaMemoryTypeDevice) return info;
    info.type = MemoryType::kDevice;
    info.device = a.device;
    CUdeviceptr base = 0;
    size_t bytes = 0;
    if (driver_.range == nullptr || driver_.range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
      return Status::unavailable("CUDA: cuMemGetAddressRange failed for a device pointer");
    }
    info.base = base;
    info.bytes = bytes;
    int capable = 0;
    if (driver_.attribute != nullptr &&
        driver_.attribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                          reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS &&
        capable != 0) {
      info.exportable = true;
    } else {
      info.why_not = kNotLegacyIpcCapable;
    }
    return info;
  }

  Result<std::string> export_memory(const void* base) override {
    KVB_ASSIGN_OR_RETURN(PointerInfo info, pointer_info(base));
    if (info.type != MemoryType::kDevice) {
      return Status::invalid_argument("CUDA: export_memory: not device memory");
    }
    KVB_CUDA_SCOPE(info.device);
    cudaIpcMemHandle_t h{};
    KVB_CUDA_TRY(cudaIpcGetMemHandle(&h, const_cast<void*>(base)), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  Result<void*> open_memory(std::string_view handle, int device) override {
    KVB_RETURN_IF_ERROR(ready());
    cudaIpcMemHandle_t h{};
    if (handle.size() != sizeof(h)) return Status::invalid_argument("CUDA: open_memory: not a cudaIpcMemHandle_t");
    std::memcpy(&h, handle.data(), sizeof(h));
    KVB_CUDA_SCOPE(device);
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e == cudaErrorAlreadyMapped) {
      (void)cudaGetLastError();
      return Status::already_exists("CUDA: cudaIpcOpenMemHandle: this handle is already open on cuda:" +
                                    std::to_string(device) + " in this process");
    }
    if (e != cudaSuccess) return cuda_error(e, "cudaIpcOpenMemHandle on cuda:" + std::to_string(device), true);
    return p;
  }

  Status close_memory(void* opened) override {
    KVB_ASSIGN_OR_RETURN(PointerInfo info, pointer_info(opened));
    KVB_CUDA_SCOPE(info.device >= 0 ? info.device : 0);
    KVB_CUDA_TRY(cudaIpcCloseMemHandle(opened), "cudaIpcCloseMemHandle");
    return Status();
  }

  Result<Stream> create_stream(int device) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_SCOPE(device);
    auto* s = new RealStream();
    s->device = device;
    cudaError_t e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
    const char* what = "cudaStreamCreateWithFlags";
    if (e == cudaSuccess) {
      what = "cudaMallocHost of the stream's pieces";
      e = cudaMallocHost(reinterpret_cast<void**>(&s->ring.staging), PieceRing::kPieces * sizeof(gather::Piece));
    }
    if (e == cudaSuccess) {
      what = "cudaMalloc of the stream's pieces";
      e = cudaMalloc(reinterpret_cast<void**>(&s->ring.pieces), PieceRing::kPieces * sizeof(gather::Piece));
    }
    for (size_t i = 0; e == cudaSuccess && i < PieceRing::kLaunches; ++i) {
      what = "cudaEventCreateWithFlags";
      cudaEvent_t ev = nullptr;
      e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e == cudaSuccess) s->ring.spare.push_back(ev);
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      destroy_stream(s);
      return cuda_error(e, what);
    }
    return static_cast<Stream>(s);
  }

  void destroy_stream(Stream stream) override {
    auto* s = static_cast<RealStream*>(stream);
    DeviceScope scope(driver_, s->device);
    if (s->stream != nullptr) (void)cudaStreamSynchronize(s->stream);
    if (s->ring.staging != nullptr) (void)cudaFreeHost(s->ring.staging);
    if (s->ring.pieces != nullptr) (void)cudaFree(s->ring.pieces);
    for (const PieceRing::Busy& b : s->ring.busy) (void)cudaEventDestroy(b.event);
    for (cudaEvent_t e : s->ring.spare) (void)cudaEventDestroy(e);
    if (s->stream != nullptr) (void)cudaStreamDestroy(s->stream);
    delete s;
  }

  Result<Event> create_event(int device, bool interprocess) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_SCOPE(device);
    cudaEvent_t e = nullptr;
    KVB_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | (interprocess ? cudaEventInterprocess : 0)),
                 "cudaEventCreateWithFlags");
    std::lock_guard<std::mutex> lock(events_mu_);
    events_[e] = EventInfo{device, false};
    return static_cast<Event>(e);
  }

  void destroy_event(Event event) override {
    {
      std::lock_guard<std::mutex> lock(events_mu_);
      events_.erase(static_cast<cudaEvent_t>(event));
    }
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }

  Result<std::string> export_event(Event event) override {
    cudaIpcEventHandle_t h{};
    KVB_CUDA_TRY(cudaIpcGetEventHandle(&h, static_cast<cudaEvent_t>(event)), "cudaIpcGetEventHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  Result<Event> open_event(std::string_view handle) override {
    KVB_RETURN_IF_ERROR(ready());
    cudaIpcEventHandle_t h{};
    if (handle.size() != sizeof(h)) return Status::invalid_argument("CUDA: open_event: not a cudaIpcEventHandle_t");
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t e = nullptr;
    if (const cudaError_t opened = cudaIpcOpenEventHandle(&e, h); opened != cudaSuccess) {
      return cuda_error(opened, "cudaIpcOpenEventHandle", true);
    }
    return static_cast<Event>(e);
  }

  Status record(Event event, Stream stream) override {
    auto* s = static_cast<RealStream*>(stream);
    {
      std::lock_guard<std::mutex> lock(events_mu_);
      auto it = events_.find(static_cast<cudaEvent_t>(event));
      if (it != events_.end() && it->second.device != s->device) {
        return Status::invalid_argument("CUDA: cudaEventRecord: an event of cuda:" + std::to_string(it->second.device) +
                                        " cannot be recorded on a stream of cuda:" + std::to_string(s->device));
      }
    }
    KVB_CUDA_SCOPE(s->device);
    KVB_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(event), s->stream), "cudaEventRecord");
    std::lock_guard<std::mutex> lock(events_mu_);
    if (auto it = events_.find(static_cast<cudaEvent_t>(event)); it != events_.end()) it->second.recorded = true;
    return Status();
  }

  Status wait_event(Stream stream, Event event) override {
    auto* s = static_cast<RealStream*>(stream);
    KVB_CUDA_SCOPE(s->device);
    KVB_CUDA_TRY(cudaStreamWaitEvent(s->stream, static_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent");
    return Status();
  }

  Result<bool> done(Event event) override {
    {
      std::lock_guard<std::mutex> lock(events_mu_);
      auto it = events_.find(static_cast<cudaEvent_t>(event));
      if (it != events_.end() && !it->second.recorded) {
        return Status::invalid_argument("CUDA: the event (of cuda:" + std::to_string(it->second.device) +
                                        ") was never recorded: CUDA would call it complete before its work was "
                                        "queued");
      }
    }
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    return cuda_error(e, "cudaEventQuery");
  }

  Status enable_peer_access(int device, int peer) override {
    KVB_RETURN_IF_ERROR(ready());
    if (device == peer) return Status();
    int can = 0;
    KVB_CUDA_TRY(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
    if (can == 0) {
      return Status::unavailable("CUDA: cuda:" + std::to_string(device) + " cannot access cuda:" +
                                 std::to_string(peer) + "'s memory directly (no peer access between them)");
    }
    KVB_CUDA_SCOPE(device);
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return Status();
    }
    KVB_CUDA_TRY(
        e, "cudaDeviceEnablePeerAccess(cuda:" + std::to_string(device) + " -> cuda:" + std::to_string(peer) + ")");
    return Status();
  }

  Status copy(Stream stream, std::span<const DeviceCopy> copies, CopyMethod method, uint32_t max_blocks) override {
    if (copies.empty()) return Status();
    auto* s = static_cast<RealStream*>(stream);
    KVB_CUDA_SCOPE(s->device);
    if (method == CopyMethod::kKernel) {
      Result<bool> launched = copy_by_kernel(*s, copies, max_blocks);
      if (!launched.ok() || *launched) return launched.ok() ? Status() : launched.error();
      // The ring had no room: the copy engines take this batch.
    }
#if CUDART_VERSION < 12080
#error "the cuda device needs CUDA 12.8 or later (cudaMemcpyBatchAsync); CMakeLists.txt says so at configure"
#endif
    std::vector<void*> dsts(copies.size());
    std::vector<const void*> srcs(copies.size());
    std::vector<size_t> sizes(copies.size());
    for (size_t i = 0; i < copies.size(); ++i) {
      dsts[i] = copies[i].dst;
      srcs[i] = copies[i].src;
      sizes[i] = copies[i].bytes;
    }
    // One attribute for the whole batch: sources are read in stream order
    // (after whatever the stream waited for), and the copies should leave
    // the SMs to the model.
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
#if CUDART_VERSION >= 13000
    // CUDA 13: const arrays, no failure index.
    const cudaError_t e =
        cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attr, &first, 1, s->stream);
    size_t fail = SIZE_MAX;
#else
    // CUDA 12.8 and 12.9: mutable arrays, and the index of the copy that failed.
    size_t fail = SIZE_MAX;
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                               copies.size(), &attr, &first, 1, &fail, s->stream);
#endif
    if (e != cudaSuccess) {
      return cuda_error(e, "cudaMemcpyBatchAsync of " + std::to_string(copies.size()) +
                               " copies on cuda:" + std::to_string(s->device) + describe_failed(copies, fail));
    }
    return Status();
  }

  Status copy_each(Stream stream, std::span<const DeviceCopy> copies) override {
    auto* s = static_cast<RealStream*>(stream);
    KVB_CUDA_SCOPE(s->device);
    for (size_t i = 0; i < copies.size(); ++i) {
      const DeviceCopy& c = copies[i];
      KVB_CUDA_TRY(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, s->stream),
                   "cudaMemcpyAsync" + describe_failed(copies, i));
    }
    return Status();
  }

  Result<void*> allocate(int device, uint64_t bytes, bool managed) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_SCOPE(device);
    void* p = nullptr;
    if (managed) {
      KVB_CUDA_TRY(cudaMallocManaged(&p, bytes), "cudaMallocManaged");
    } else {
      KVB_CUDA_TRY(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes");
    }
    return p;
  }

  // cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess (driver
  // entry points), as PyTorch's expandable segments allocate.
  Result<void*> allocate_unexportable(int device, uint64_t bytes) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_SCOPE(device);
    KVB_ASSIGN_OR_RETURN(VmmAllocation a, vmm_allocate(driver_, device, bytes));
    std::lock_guard<std::mutex> lock(vmm_mu_);
    vmm_[a.at] = {a.handle, a.size};
    return reinterpret_cast<void*>(a.at);
  }

  Status free(void* p) override {
    {
      std::lock_guard<std::mutex> lock(vmm_mu_);
      auto it = vmm_.find(reinterpret_cast<CUdeviceptr>(p));
      if (it != vmm_.end()) {
        (void)driver_.unmap(it->first, it->second.second);
        (void)driver_.release(it->second.first);
        (void)driver_.address_free(it->first, it->second.second);
        vmm_.erase(it);
        return Status();
      }
    }
    KVB_ASSIGN_OR_RETURN(PointerInfo info, pointer_info(p));
    KVB_CUDA_SCOPE(info.device >= 0 ? info.device : 0);
    KVB_CUDA_TRY(cudaFree(p), "cudaFree");
    return Status();
  }

  Status fill_after(Stream stream, void* p, uint64_t bytes, uint8_t value, std::chrono::microseconds delay) override {
    auto* s = static_cast<RealStream*>(stream);
    KVB_CUDA_SCOPE(s->device);
    KVB_CUDA_TRY(launch_fill_after(p, bytes, value, static_cast<uint64_t>(delay.count()) * 1000, s->stream),
                 "the fill kernel");
    return Status();
  }

  // One kernel over every leaf of the ranges, on a stream of its own (the
  // caller waited for the ranges' producers), with its table and output in
  // stream-ordered memory; the leaves' hashes come back for the roots.
  Status content_hashes(int device, std::span<const DeviceRange> ranges, std::vector<uint64_t>* hashes) override {
    KVB_RETURN_IF_ERROR(ready());
    hashes->clear();
    std::vector<KernelRange> table;
    uint64_t leaves = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
      const DeviceRange& r = ranges[i];
      KVB_ASSIGN_OR_RETURN(PointerInfo info, pointer_info(r.p));
      const uint64_t at = reinterpret_cast<uint64_t>(r.p);
      if (info.type != MemoryType::kDevice || info.device != device || at + r.bytes > info.base + info.bytes) {
        return Status::invalid_argument("content_hashes: range " + std::to_string(i) + " (" + std::to_string(r.bytes) +
                                        " bytes) is not device memory of cuda:" + std::to_string(device) +
                                        " inside one allocation");
      }
      if (r.bytes == 0) continue;
      table.push_back({at, r.bytes, leaves});
      leaves += xxh3::content_leaves(r.bytes);
    }
    std::vector<uint64_t> out(leaves);
    if (leaves > 0) {
      KVB_CUDA_SCOPE(device);
      cudaStream_t stream = nullptr;
      KVB_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      const size_t table_bytes = table.size() * sizeof(KernelRange);
      void* d = nullptr;
      auto run = [&]() -> Status {
        KVB_CUDA_TRY(cudaMallocAsync(&d, table_bytes + leaves * sizeof(uint64_t), stream), "cudaMallocAsync");
        auto* out_d = reinterpret_cast<uint64_t*>(static_cast<char*>(d) + table_bytes);
        KVB_CUDA_TRY(cudaMemcpyAsync(d, table.data(), table_bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
        KVB_CUDA_TRY(launch_content_leaves(static_cast<const KernelRange*>(d), static_cast<uint32_t>(table.size()),
                                           leaves, out_d, stream),
                     "the content hash kernel");
        KVB_CUDA_TRY(cudaMemcpyAsync(out.data(), out_d, leaves * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync");
        KVB_CUDA_TRY(cudaStreamSynchronize(stream), "the content hash kernel");
        return Status();
      };
      const Status s = run();
      if (d != nullptr) (void)cudaFreeAsync(d, stream);
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
      KVB_RETURN_IF_ERROR(s);
    }
    size_t k = 0;
    for (const DeviceRange& r : ranges) {
      const uint64_t n = xxh3::content_leaves(r.bytes);
      hashes->push_back(xxh3::content_root(out.data() + k, n));
      k += n;
    }
    return Status();
  }

  // Portable: pinned for every device's context. CUDA needs a context to
  // pin in: the thread's current one, or device 0's when it has none.
  Status register_host(void* p, uint64_t bytes) override {
    KVB_RETURN_IF_ERROR(ready());
    CUcontext now = nullptr;
    int device = 0;
    if (driver_.get_ctx != nullptr && driver_.get_ctx(&now) == CUDA_SUCCESS && now != nullptr) {
      (void)cudaGetDevice(&device);
    }
    KVB_CUDA_SCOPE(device);
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();
      return Status::already_exists("CUDA: cudaHostRegister: the range overlaps host memory already pinned");
    }
    KVB_CUDA_TRY(e, "cudaHostRegister of " + std::to_string(bytes) + " bytes");
    return Status();
  }

  Status unregister_host(void* p) override {
    const cudaError_t e = cudaHostUnregister(p);
    if (e == cudaErrorHostMemoryNotRegistered) {
      (void)cudaGetLastError();
      return Status::invalid_argument("CUDA: cudaHostUnregister: no pinned range starts there");
    }
    KVB_CUDA_TRY(e, "cudaHostUnregister");
    return Status();
  }

  Status copy_sync(void* dst, const void* src, uint64_t bytes) override {
    KVB_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
    return Status();
  }

 private:
  // Looks up the driver entry points once; kUnavailable without a device.
  Status ready() {
    std::call_once(once_, [&] {
      Result<int> n = count();
      if (!n.ok()) {
        ready_ = n.error();
        return;
      }
      auto find = [](const char* name) -> void* {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q{};
        return cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) == cudaSuccess ? fn : nullptr;
      };
      driver_.range = reinterpret_cast<MemGetAddressRangeFn>(find("cuMemGetAddressRange"));
      driver_.attribute = reinterpret_cast<PointerGetAttributeFn>(find("cuPointerGetAttribute"));
      driver_.get_ctx = reinterpret_cast<CtxGetCurrentFn>(find("cuCtxGetCurrent"));
      driver_.set_ctx = reinterpret_cast<CtxSetCurrentFn>(find("cuCtxSetCurrent"));
      driver_.granularity = reinterpret_cast<decltype(driver_.granularity)>(find("cuMemGetAllocationGranularity"));
      driver_.create = reinterpret_cast<decltype(driver_.create)>(find("cuMemCreate"));
      driver_.reserve = reinterpret_cast<decltype(driver_.reserve)>(find("cuMemAddressReserve"));
      driver_.map = reinterpret_cast<decltype(driver_.map)>(find("cuMemMap"));
      driver_.access = reinterpret_cast<decltype(driver_.access)>(find("cuMemSetAccess"));
      driver_.unmap = reinterpret_cast<decltype(driver_.unmap)>(find("cuMemUnmap"));
      driver_.release = reinterpret_cast<decltype(driver_.release)>(find("cuMemRelease"));
      driver_.address_free = reinterpret_cast<decltype(driver_.address_free)>(find("cuMemAddressFree"));
    });
    return ready_;
  }

  // " (copy i of n: B bytes from 0x.. to 0x..)" for a failed copy, when
  // CUDA said which.
  static std::string describe_failed(std::span<const DeviceCopy> copies, size_t i) {
    if (i >= copies.size()) return "";
    char text[160];
    std::snprintf(text, sizeof text, " (copy %zu of %zu: %llu bytes from %p to %p)", i, copies.size(),
                  static_cast<unsigned long long>(copies[i].bytes), copies[i].src, copies[i].dst);
    return text;
  }

  // Queues the batch as one kernel over its pieces; false (nothing queued)
  // when the stream's ring has no room for them.
  Result<bool> copy_by_kernel(RealStream& s, std::span<const DeviceCopy> copies, uint32_t max_blocks) {
    std::lock_guard<std::mutex> lock(s.mu);
    uint64_t n = 0;
    for (const DeviceCopy& c : copies) n += gather::pieces_of(c.bytes);
    if (n == 0) return true;
    const size_t at = s.ring.reserve(static_cast<size_t>(n));
    if (at == SIZE_MAX) return false;
    gather::Piece* out = s.ring.staging + at;
    for (const DeviceCopy& c : copies) {
      const auto dst = reinterpret_cast<uint64_t>(c.dst), src = reinterpret_cast<uint64_t>(c.src);
      for (uint64_t off = 0; off < c.bytes; off += gather::kPieceBytes) {
        *out++ = gather::Piece{dst + off, src + off, std::min(gather::kPieceBytes, c.bytes - off)};
      }
    }
    KVB_CUDA_TRY(cudaMemcpyAsync(s.ring.pieces + at, s.ring.staging + at, n * sizeof(gather::Piece),
                                 cudaMemcpyHostToDevice, s.stream),
                 "cudaMemcpyAsync of the kernel's pieces");
    KVB_CUDA_TRY(launch_gather_scatter(s.ring.pieces + at, static_cast<uint32_t>(n), max_blocks, s.stream),
                 "the gather/scatter kernel over " + std::to_string(copies.size()) +
                     " copies on cuda:" + std::to_string(s.device));
    cudaEvent_t ev = s.ring.spare.back();
    KVB_CUDA_TRY(cudaEventRecord(ev, s.stream), "cudaEventRecord");
    s.ring.spare.pop_back();
    s.ring.busy.push_back(PieceRing::Busy{ev, at, at + static_cast<size_t>(n)});
    s.ring.head = at + static_cast<size_t>(n);
    return true;
  }

  std::once_flag once_;
  Status ready_;
  Driver driver_;
  std::mutex events_mu_;
  std::map<cudaEvent_t, EventInfo> events_;  // the events this process made here
  std::mutex vmm_mu_;
  std::map<CUdeviceptr, std::pair<CUmemGenericAllocationHandle, size_t>> vmm_;  // allocate_unexportable's
};

}  // namespace

Device& real() {
  static CudaDevice* device = new CudaDevice();  // never destroyed: the runtime tears itself down at exit
  return *device;
}

}  // namespace kvbridge::device

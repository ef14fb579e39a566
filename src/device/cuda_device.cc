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
//  - cudaIpcOpenMemHandle maps a whole allocation, once per process; the
//    mapping is closed with cudaIpcCloseMemHandle.
//  - cudaMemcpyBatchAsync (CUDA 12.8+) cannot run on the legacy default
//    stream: every stream here is cudaStreamNonBlocking.
//  - The kernel path reads a descriptor array from device memory: each
//    stream keeps a pinned staging buffer and a device buffer for it, and
//    an event that says when the last kernel stopped reading them.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/xxh3.h"
#include "device/cuda_errors.h"
#include "device/device.h"
#include "device/kernels.h"

namespace kvbridge::device {
namespace {

// cuda_errors.cc maps these by number.
static_assert(cudaErrorInvalidValue == 1 && cudaErrorMemoryAllocation == 2 && cudaErrorInitializationError == 3 &&
              cudaErrorInvalidDevicePointer == 17 && cudaErrorInsufficientDriver == 35 && cudaErrorNoDevice == 100 &&
              cudaErrorInvalidDevice == 101 && cudaErrorMapBufferObjectFailed == 205 &&
              cudaErrorInvalidResourceHandle == 400);
static_assert(cudaErrorIllegalAddress == 700 && cudaErrorLaunchTimeout == 702 && cudaErrorAssert == 710 &&
              cudaErrorHardwareStackError == 714 && cudaErrorIllegalInstruction == 715 &&
              cudaErrorMisalignedAddress == 716 && cudaErrorInvalidAddressSpace == 717 && cudaErrorInvalidPc == 718 &&
              cudaErrorLaunchFailure == 719 && cudaErrorTensorMemoryLeak == 721 && cudaErrorMpsClientTerminated == 810);

Status cuda_error(cudaError_t e, const std::string& what, bool opening = false) {
  return cuda_status(static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e), what, opening);
}

#define KVB_CUDA_TRY(expr, what)                                \
  do {                                                          \
    const cudaError_t kvb_e = (expr);                           \
    if (kvb_e != cudaSuccess) return cuda_error(kvb_e, (what)); \
  } while (0)

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);

struct RealStream {
  cudaStream_t stream = nullptr;
  int device = 0;
  // The kernel path's descriptor buffers, and when the last kernel that read
  // them ended.
  std::mutex mu;
  KernelCopy* staging = nullptr;      // pinned host
  KernelCopy* descriptors = nullptr;  // device
  size_t capacity = 0;
  cudaEvent_t buffers_free = nullptr;
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
    if (range_ == nullptr || range_(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
      return Status::unavailable("CUDA: cuMemGetAddressRange failed for a device pointer");
    }
    info.base = base;
    info.bytes = bytes;
    int capable = 0;
    if (attribute_ != nullptr &&
        attribute_(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, reinterpret_cast<CUdeviceptr>(p)) ==
            CUDA_SUCCESS &&
        capable != 0) {
      info.exportable = true;
    } else {
      info.why_not =
          "it was not allocated by cudaMalloc (memory from cuMemCreate, as PyTorch's expandable segments make, has "
          "no legacy IPC handle: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)";
    }
    return info;
  }

  Result<std::string> export_memory(const void* base) override {
    KVB_RETURN_IF_ERROR(ready());
    cudaIpcMemHandle_t h{};
    KVB_CUDA_TRY(cudaIpcGetMemHandle(&h, const_cast<void*>(base)), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  Result<void*> open_memory(std::string_view handle) override {
    KVB_RETURN_IF_ERROR(ready());
    cudaIpcMemHandle_t h{};
    if (handle.size() != sizeof(h)) return Status::invalid_argument("CUDA: open_memory: not a cudaIpcMemHandle_t");
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e == cudaErrorAlreadyMapped) {
      (void)cudaGetLastError();
      return Status::already_exists("CUDA: cudaIpcOpenMemHandle: this handle is already open in this process");
    }
    if (e != cudaSuccess) return cuda_error(e, "cudaIpcOpenMemHandle", true);
    return p;
  }

  Status close_memory(void* opened) override {
    KVB_CUDA_TRY(cudaIpcCloseMemHandle(opened), "cudaIpcCloseMemHandle");
    return Status();
  }

  Result<Stream> create_stream(int device) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    auto* s = new RealStream();
    s->device = device;
    cudaError_t e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->buffers_free, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      destroy_stream(s);
      return cuda_error(e, "cudaStreamCreateWithFlags");
    }
    return static_cast<Stream>(s);
  }

  void destroy_stream(Stream stream) override {
    auto* s = static_cast<RealStream*>(stream);
    if (s->stream != nullptr) (void)cudaStreamSynchronize(s->stream);
    if (s->staging != nullptr) (void)cudaFreeHost(s->staging);
    if (s->descriptors != nullptr) (void)cudaFree(s->descriptors);
    if (s->buffers_free != nullptr) (void)cudaEventDestroy(s->buffers_free);
    if (s->stream != nullptr) (void)cudaStreamDestroy(s->stream);
    delete s;
  }

  Result<Event> create_event(int device, bool interprocess) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    cudaEvent_t e = nullptr;
    KVB_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | (interprocess ? cudaEventInterprocess : 0)),
                 "cudaEventCreateWithFlags");
    return static_cast<Event>(e);
  }

  void destroy_event(Event event) override { (void)cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

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
    KVB_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<RealStream*>(stream)->stream),
                 "cudaEventRecord");
    return Status();
  }

  Status wait_event(Stream stream, Event event) override {
    KVB_CUDA_TRY(cudaStreamWaitEvent(static_cast<RealStream*>(stream)->stream, static_cast<cudaEvent_t>(event), 0),
                 "cudaStreamWaitEvent");
    return Status();
  }

  Result<bool> done(Event event) override {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    return cuda_error(e, "cudaEventQuery");
  }

  Status copy(Stream stream, std::span<const DeviceCopy> copies, CopyMethod method, uint32_t max_blocks) override {
    if (copies.empty()) return Status();
    auto* s = static_cast<RealStream*>(stream);
    if (method == CopyMethod::kKernel) return copy_by_kernel(*s, copies, max_blocks);
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
    const std::string failed;
#else
    // CUDA 12.8 and 12.9: mutable arrays, and the index of the copy that failed.
    size_t fail = SIZE_MAX;
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                               copies.size(), &attr, &first, 1, &fail, s->stream);
    const std::string failed = fail < copies.size() ? " (copy " + std::to_string(fail) + " failed)" : "";
#endif
    KVB_CUDA_TRY(e, "cudaMemcpyBatchAsync of " + std::to_string(copies.size()) + " copies" + failed);
    return Status();
  }

  Status copy_each(Stream stream, std::span<const DeviceCopy> copies) override {
    auto* s = static_cast<RealStream*>(stream);
    for (const DeviceCopy& c : copies) {
      KVB_CUDA_TRY(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, s->stream), "cudaMemcpyAsync");
    }
    return Status();
  }

  Result<void*> allocate(int device, uint64_t bytes, bool managed) override {
    KVB_RETURN_IF_ERROR(ready());
    KVB_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    void* p = nullptr;
    if (managed) {
      KVB_CUDA_TRY(cudaMallocManaged(&p, bytes), "cudaMallocManaged");
    } else {
      KVB_CUDA_TRY(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes");
    }
    return p;
  }

  Status free(void* p) override {
    KVB_CUDA_TRY(cudaFree(p), "cudaFree");
    return Status();
  }

  Status fill_after(Stream stream, void* p, uint64_t bytes, uint8_t value, std::chrono::microseconds delay) override {
    auto* s = static_cast<RealStream*>(stream);
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
      KVB_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
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
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess)
        range_ = reinterpret_cast<MemGetAddressRangeFn>(fn);
      if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess)
        attribute_ = reinterpret_cast<PointerGetAttributeFn>(fn);
    });
    return ready_;
  }

  Status copy_by_kernel(RealStream& s, std::span<const DeviceCopy> copies, uint32_t max_blocks) {
    std::lock_guard<std::mutex> lock(s.mu);
    // The previous kernel must have read its descriptors before they are
    // overwritten.
    KVB_CUDA_TRY(cudaEventSynchronize(s.buffers_free), "cudaEventSynchronize");
    if (s.capacity < copies.size()) {
      if (s.staging != nullptr) (void)cudaFreeHost(s.staging);
      if (s.descriptors != nullptr) (void)cudaFree(s.descriptors);
      s.staging = nullptr;
      s.descriptors = nullptr;
      s.capacity = 0;
      const size_t want = std::max<size_t>(copies.size(), 1024);
      KVB_CUDA_TRY(cudaSetDevice(s.device), "cudaSetDevice");
      KVB_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&s.staging), want * sizeof(KernelCopy)), "cudaMallocHost");
      KVB_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&s.descriptors), want * sizeof(KernelCopy)), "cudaMalloc");
      s.capacity = want;
    }
    for (size_t i = 0; i < copies.size(); ++i) {
      s.staging[i] = KernelCopy{reinterpret_cast<uint64_t>(copies[i].dst), reinterpret_cast<uint64_t>(copies[i].src),
                                copies[i].bytes};
    }
    KVB_CUDA_TRY(
        cudaMemcpyAsync(s.descriptors, s.staging, copies.size() * sizeof(KernelCopy), cudaMemcpyHostToDevice, s.stream),
        "cudaMemcpyAsync of the descriptors");
    KVB_CUDA_TRY(launch_gather_scatter(s.descriptors, static_cast<uint32_t>(copies.size()), max_blocks, s.stream),
                 "the gather/scatter kernel");
    KVB_CUDA_TRY(cudaEventRecord(s.buffers_free, s.stream), "cudaEventRecord");
    return Status();
  }

  std::once_flag once_;
  Status ready_;
  MemGetAddressRangeFn range_ = nullptr;
  PointerGetAttributeFn attribute_ = nullptr;
};

}  // namespace

Device& real() {
  static CudaDevice* device = new CudaDevice();  // never destroyed: the runtime tears itself down at exit
  return *device;
}

}  // namespace kvbridge::device

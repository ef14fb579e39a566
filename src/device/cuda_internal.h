// device/cuda_internal.h: what cuda_device.cc builds on, apart so that file
// stays about the Device itself: CUDA errors as Status, the driver entry
// points it looks up, the scope that makes a device current and puts the
// thread's context back, and each stream's ring of the kernel's pieces.
// Only built with CUDA; included by cuda_device.cc alone.
//
// Thread-safety: DeviceScope is the calling thread's; a PieceRing is its
// stream's, used under that stream's lock.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "device/cuda_errors.h"
#include "device/gather.h"
#include "kvbridge/status.h"

namespace kvbridge::device {
namespace cuda_internal {

// cuda_errors.cc maps these by number.
static_assert(cudaErrorInvalidValue == 1 && cudaErrorMemoryAllocation == 2 && cudaErrorInitializationError == 3 &&
              cudaErrorInvalidDevicePointer == 17 && cudaErrorInsufficientDriver == 35 && cudaErrorNoDevice == 100 &&
              cudaErrorInvalidDevice == 101 && cudaErrorMapBufferObjectFailed == 205 &&
              cudaErrorInvalidResourceHandle == 400);
static_assert(cudaErrorIllegalAddress == 700 && cudaErrorLaunchTimeout == 702 && cudaErrorAssert == 710 &&
              cudaErrorHardwareStackError == 714 && cudaErrorIllegalInstruction == 715 &&
              cudaErrorMisalignedAddress == 716 && cudaErrorInvalidAddressSpace == 717 && cudaErrorInvalidPc == 718 &&
              cudaErrorLaunchFailure == 719 && cudaErrorTensorMemoryLeak == 721 && cudaErrorMpsClientTerminated == 810);

inline Status cuda_error(cudaError_t e, const std::string& what, bool opening = false) {
  return cuda_status(static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e), what, opening);
}

#define KVB_CUDA_TRY(expr, what)                                \
  do {                                                          \
    const cudaError_t kvb_e = (expr);                           \
    if (kvb_e != cudaSuccess) return cuda_error(kvb_e, (what)); \
  } while (0)

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
using CtxSetCurrentFn = CUresult (*)(CUcontext);

// The driver entry points this file looks up (cuda_device.cc's header).
struct Driver {
  MemGetAddressRangeFn range = nullptr;
  PointerGetAttributeFn attribute = nullptr;
  CtxGetCurrentFn get_ctx = nullptr;
  CtxSetCurrentFn set_ctx = nullptr;
  // allocate_unexportable's
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
};

// Makes `device` current for a scope, then puts the thread's context back
// (none, if it had none).
class DeviceScope {
 public:
  DeviceScope(const Driver& driver, int device) : driver_(driver) {
    int now = -1;
    if (driver_.get_ctx != nullptr && driver_.get_ctx(&saved_) == CUDA_SUCCESS && saved_ != nullptr &&
        cudaGetDevice(&now) == cudaSuccess && now == device) {
      return;  // already current
    }
    status_ = cudaSetDevice(device);
    restore_ = driver_.set_ctx != nullptr;
  }
  ~DeviceScope() {
    if (restore_) (void)driver_.set_ctx(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  const Driver& driver_;
  CUcontext saved_ = nullptr;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

#define KVB_CUDA_SCOPE(device)                                                                                \
  DeviceScope kvb_scope(driver_, (device));                                                                   \
  if (kvb_scope.status() != cudaSuccess) {                                                                    \
    return cuda_error(kvb_scope.status(), "cudaSetDevice(" + std::to_string(static_cast<int>(device)) + ")"); \
  }

// The kernel path's ring of pieces (see the file's header).
struct PieceRing {
  static constexpr size_t kPieces = size_t{1} << 16;  // 1.5 MiB pinned and 1.5 MiB device memory per stream
  static constexpr size_t kLaunches = 16;             // launches in flight on the stream
  gather::Piece* staging = nullptr;                   // pinned host
  gather::Piece* pieces = nullptr;                    // device
  size_t head = 0;
  struct Busy {
    cudaEvent_t event;
    size_t begin, end;
  };
  std::deque<Busy> busy;
  std::vector<cudaEvent_t> spare;

  // Gives back the regions of launches that ended; then the first of `n`
  // free slots, or SIZE_MAX when there is no room (or no spare event).
  size_t reserve(size_t n) {
    while (!busy.empty() && cudaEventQuery(busy.front().event) == cudaSuccess) {
      spare.push_back(busy.front().event);
      busy.pop_front();
    }
    (void)cudaGetLastError();
    if (n > kPieces || spare.empty()) return SIZE_MAX;
    if (busy.empty()) return head = 0;
    // In flight: [tail, head), wrapped when head < tail; full when equal.
    const size_t tail = busy.front().begin;
    if (head == tail) return SIZE_MAX;
    if (head > tail) {
      if (kPieces - head >= n) return head;
      return tail >= n ? 0 : SIZE_MAX;  // wrap
    }
    return tail - head >= n ? head : SIZE_MAX;
  }
};

// Device memory of the current device from cuMemCreate, mapped read-write
// at an address of its own (as PyTorch's expandable segments allocate):
// the address, its handle and its rounded size.
struct VmmAllocation {
  CUdeviceptr at = 0;
  CUmemGenericAllocationHandle handle = 0;
  size_t size = 0;
};
inline Result<VmmAllocation> vmm_allocate(const Driver& driver, int device, uint64_t bytes) {
  if (driver.create == nullptr || driver.reserve == nullptr || driver.map == nullptr || driver.access == nullptr ||
      driver.granularity == nullptr) {
    return Status::unavailable("CUDA: the driver has no virtual memory management entry points");
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t grain = 0;
  if (driver.granularity(&grain, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || grain == 0) {
    return Status::unavailable("CUDA: cuMemGetAllocationGranularity failed");
  }
  VmmAllocation a;
  a.size = (bytes + grain - 1) / grain * grain;
  if (driver.create(&a.handle, a.size, &prop, 0) != CUDA_SUCCESS)
    return Status::resource_exhausted("CUDA: cuMemCreate");
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (driver.reserve(&a.at, a.size, 0, 0, 0) != CUDA_SUCCESS ||
      driver.map(a.at, a.size, 0, a.handle, 0) != CUDA_SUCCESS ||
      driver.access(a.at, a.size, &access, 1) != CUDA_SUCCESS) {
    return Status::unavailable("CUDA: cuMemAddressReserve/cuMemMap/cuMemSetAccess failed");
  }
  return a;
}

}  // namespace cuda_internal
}  // namespace kvbridge::device

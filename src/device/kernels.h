// device/kernels.h: the launchers of the project's CUDA kernels, one .cu
// per concern (copy_kernel.cu, fill_kernel.cu, content_kernel.cu), called by
// cuda_device.cc.
// Only built with CUDA; the only file besides cuda_device.cc that names
// CUDA types.
//
// Thread-safety: each launch queues on the given stream and returns; the
// caller keeps every pointer valid until the stream passed the kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvbridge::device {

// One descriptor of the gather/scatter kernel, as it sits in device memory.
struct KernelCopy {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;
};

// Copies every descriptor of `descriptors` (device memory, `count` of
// them) on `stream`, one thread block per descriptor at a time, on a grid
// of at most `max_blocks` blocks (0: kDefaultCopyBlocks), so the copy
// leaves most SMs to the model. 16-byte vectors where both sides and the
// length allow, bytes otherwise.
inline constexpr uint32_t kDefaultCopyBlocks = 32;
cudaError_t launch_gather_scatter(const KernelCopy* descriptors, uint32_t count, uint32_t max_blocks,
                                  cudaStream_t stream);

// One range of the content hash kernel, as it sits in device memory: its
// leaves are [first_leaf, first_leaf + content_leaves(bytes)) of the output.
struct KernelRange {
  uint64_t address = 0;
  uint64_t bytes = 0;
  uint64_t first_leaf = 0;
};

// Hashes every 64 KiB leaf of `ranges` (device memory, `count` of them,
// sorted by first_leaf, none empty) into out[first_leaf + i] (device memory
// of `leaves` u64s), one thread per leaf (common/xxh3.h).
cudaError_t launch_content_leaves(const KernelRange* ranges, uint32_t count, uint64_t leaves, uint64_t* out,
                                  cudaStream_t stream);

// Waits about `delay_ns` on the device (the global timer), then sets
// `bytes` at `p` to `value`: a slow producer, for ordering tests.
cudaError_t launch_fill_after(void* p, uint64_t bytes, uint8_t value, uint64_t delay_ns, cudaStream_t stream);

}  // namespace kvbridge::device

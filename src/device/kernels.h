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

#include "device/gather.h"

namespace kvbridge::device {

// Copies every piece of `pieces` (device memory, `count` of them, as
// gather::cut() makes them) on `stream`, a warp per piece at a time
// (gather.h), on a grid of at most `max_blocks` blocks of 512 threads (0:
// kDefaultCopyBlocks), so the copy leaves most SMs to the model.
inline constexpr uint32_t kDefaultCopyBlocks = 32;
cudaError_t launch_gather_scatter(const gather::Piece* pieces, uint32_t count, uint32_t max_blocks,
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

// The slow fill kernel (kernels.h): a producer that finishes late, for the
// tests that check a transfer waits for the producer's event. Every thread
// first waits on the global nanosecond timer, then the grid sets its share
// of the bytes.
#include "device/kernels.h"

namespace kvbridge::device {
namespace {

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void fill_after(uint8_t* p, uint64_t bytes, uint8_t value, uint64_t delay_ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < delay_ns) __nanosleep(1000);
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < bytes; i += uint64_t{gridDim.x} * blockDim.x)
    p[i] = value;
}

}  // namespace

cudaError_t launch_fill_after(void* p, uint64_t bytes, uint8_t value, uint64_t delay_ns, cudaStream_t stream) {
  fill_after<<<64, 256, 0, stream>>>(static_cast<uint8_t*>(p), bytes, value, delay_ns);
  return cudaGetLastError();
}

}  // namespace kvbridge::device

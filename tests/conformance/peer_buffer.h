// tests/conformance/peer_buffer.h: a conformance peer's buffer: host memory,
// or device memory of the host fake (device.h), which the test reads and
// writes directly since the fake's device memory is host memory.
//
// Host memory is HostMemory's (host_memory.h): zero from the start without
// a pass over it. (Under ThreadSanitizer, zeroing 72 MiB with memset took
// 2 s, a third of each Link conformance case.)
// Header-only, for tests.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "device/device.h"
#include "kvbridge/host_memory.h"
#include "kvbridge/status.h"

namespace kvbridge::conformance {

class PeerBuffer {
 public:
  PeerBuffer() = default;
  // `memory` "host" or "cuda:N" (the fake only: KVB_DEVICE=fake).
  static Result<PeerBuffer> create(uint64_t bytes, const std::string& memory) {
    PeerBuffer b;
    b.bytes_ = bytes;
    if (memory == "host") {
      KVB_ASSIGN_OR_RETURN(b.host_, HostMemory::allocate(bytes));
      b.data_ = b.host_.data();
      return b;
    }
    KVB_ASSIGN_OR_RETURN(int n, device::parse_cuda_memory(memory));
    if (device::current().name() != "fake") {
      return Status::unavailable("a conformance peer's device memory is the host fake's: set KVB_DEVICE=fake");
    }
    KVB_ASSIGN_OR_RETURN(void* p, device::current().allocate(n, bytes));
    b.data_ = static_cast<uint8_t*>(p);
    b.device_ = true;
    return b;
  }
  PeerBuffer(PeerBuffer&& o) noexcept { *this = std::move(o); }
  PeerBuffer& operator=(PeerBuffer&& o) noexcept {
    std::swap(host_, o.host_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(device_, o.device_);
    return *this;
  }
  ~PeerBuffer() {
    if (device_ && data_ != nullptr) (void)device::current().free(data_);
  }
  uint8_t* data() { return data_; }
  size_t size() const { return bytes_; }

 private:
  HostMemory host_;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  bool device_ = false;
};

}  // namespace kvbridge::conformance

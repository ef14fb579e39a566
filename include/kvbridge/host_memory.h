// kvbridge/host_memory.h: host memory for a KV cache (or a CPU tier of one)
// that copies between processes fast.
//
// A cross-process copy (cma's process_vm_readv/writev) pays per page it
// touches: the kernel pins and maps each page, and on a virtual machine
// whose hypervisor shadows the guest's page tables the first copy over a
// page costs several times the later ones. With 2 MiB pages there are 512 times fewer. HostMemory maps
// anonymous memory aligned to 2 MiB and asks the kernel for transparent
// huge pages on it (madvise(MADV_HUGEPAGE)); where the kernel declines
// (transparent_hugepage=never, another OS) it is ordinary memory and
// huge_pages() says why not. Pages are not touched here: the kernel
// backs each 2 MiB on first touch, so register it with Engine as any span.
//
// Thread-safety: a value; moving it while another thread uses data() is a
// race, reading data() from several threads is safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kvbridge/status.h"

namespace kvbridge {

class HostMemory {
 public:
  // The alignment and the rounding of every allocation.
  static constexpr uint64_t kHugePageBytes = uint64_t{2} << 20;

  // Maps `bytes` (> 0) rounded up to kHugePageBytes. Errors:
  // invalid_argument for 0, resource_exhausted naming the size when the
  // mapping fails.
  static Result<HostMemory> allocate(uint64_t bytes);

  HostMemory() = default;
  HostMemory(HostMemory&& other) noexcept;
  HostMemory& operator=(HostMemory&& other) noexcept;
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  ~HostMemory();  // unmaps

  uint8_t* data() const { return data_; }
  // The bytes asked for (the mapping may be larger, up to the next 2 MiB).
  uint64_t size() const { return size_; }
  std::span<uint8_t> span() const { return {data_, static_cast<size_t>(size_)}; }

  // True when the kernel took the advice; else huge_pages_note() says why
  // (madvise's error, e.g. "madvise(MADV_HUGEPAGE): Invalid argument" on a
  // kernel without transparent huge pages, or that they are set to never).
  bool huge_pages() const { return huge_pages_; }
  const std::string& huge_pages_note() const { return note_; }

  // Makes [offset, offset + bytes) resident and writable now, as a KV pool
  // is before its first request, in one call into the kernel
  // (madvise(MADV_POPULATE_WRITE)) rather than a fault per page on first
  // touch; where the kernel lacks it (before Linux 5.14) each page is
  // touched instead. The range is widened to whole pages; the bytes are
  // left as they are. On a virtual machine a fault costs far more than the
  // page's zeroing. Errors:
  // out_of_range for a range past size(), resource_exhausted naming the
  // size when the kernel has no memory for it.
  Status populate(uint64_t offset, uint64_t bytes);
  Status populate() { return populate(0, size_); }

 private:
  void release();

  uint8_t* data_ = nullptr;
  uint64_t size_ = 0, mapped_ = 0;
  bool huge_pages_ = false;
  std::string note_;
};

}  // namespace kvbridge

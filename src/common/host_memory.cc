#include "kvbridge/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "common/host.h"

namespace kvbridge {

Result<HostMemory> HostMemory::allocate(uint64_t bytes) {
  if (bytes == 0) return Status::invalid_argument("HostMemory::allocate: 0 bytes");
  if (bytes > UINT64_MAX - 2 * kHugePageBytes) {
    return Status::invalid_argument("HostMemory::allocate: " + std::to_string(bytes) + " bytes is too large");
  }
  const uint64_t mapped = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  // Over-map by one huge page and trim both ends, so the start is aligned.
  const uint64_t over = mapped + kHugePageBytes;
  void* m = ::mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    return Status::resource_exhausted("HostMemory::allocate: mmap of " + std::to_string(bytes) +
                                      " bytes: " + std::strerror(errno));
  }
  const auto base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t aligned = (base + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > base) ::munmap(m, aligned - base);
  const uintptr_t end = aligned + mapped;
  if (base + over > end) ::munmap(reinterpret_cast<void*>(end), base + over - end);
  HostMemory h;
  h.data_ = reinterpret_cast<uint8_t*>(aligned);
  h.size_ = bytes;
  h.mapped_ = mapped;
#ifdef MADV_HUGEPAGE
  if (::madvise(h.data_, mapped, MADV_HUGEPAGE) == 0) {
    const std::string mode = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
    h.huge_pages_ = mode.find("[never]") == std::string::npos;
    if (!h.huge_pages_) h.note_ = "transparent huge pages are off on this host (transparent_hugepage/enabled: never)";
  } else {
    h.note_ = std::string("madvise(MADV_HUGEPAGE): ") + std::strerror(errno);
  }
#else
  h.note_ = "this platform has no MADV_HUGEPAGE";
#endif
  return h;
}

Status HostMemory::populate(uint64_t offset, uint64_t bytes) {
  if (offset > size_ || bytes > size_ - offset) {
    return Status::out_of_range("HostMemory::populate: [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                                ") is past the " + std::to_string(size_) + " bytes allocated");
  }
  if (bytes == 0) return Status();
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page;
  const uint64_t end = std::min(mapped_, (offset + bytes + page - 1) / page * page);
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack it
#endif
  if (::madvise(data_ + begin, end - begin, MADV_POPULATE_WRITE) == 0) return Status();
  if (errno == ENOMEM || errno == EFAULT) {
    return Status::resource_exhausted("HostMemory::populate: " + std::to_string(end - begin) +
                                      " bytes: " + std::strerror(errno));
  }
  // An older kernel (EINVAL): touch each page, keeping its bytes.
  for (uint64_t at = begin; at < end; at += page) {
    volatile uint8_t* p = data_ + at;
    *p = *p;
  }
  return Status();
}

HostMemory::HostMemory(HostMemory&& other) noexcept { *this = std::move(other); }

HostMemory& HostMemory::operator=(HostMemory&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    huge_pages_ = std::exchange(other.huge_pages_, false);
    note_ = std::move(other.note_);
    other.note_.clear();
  }
  return *this;
}

HostMemory::~HostMemory() { release(); }

void HostMemory::release() {
  if (data_ != nullptr) ::munmap(data_, mapped_);
  data_ = nullptr;
  size_ = mapped_ = 0;
}

}  // namespace kvbridge

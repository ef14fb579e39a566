#include "demo_baseline.h"

#include <climits>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <string>

namespace kvbridge::cli::demo {

Result<std::vector<PeerCopies>> reads_of(const Layout& mine, std::span<const std::span<uint8_t>> memory,
                                         const std::vector<connector_internal::RemoteRankView>& sources,
                                         const Request& q) {
  std::vector<Layout> layouts;
  for (const auto& r : sources) layouts.push_back(r.layout);
  // The baseline copies what the planner says and nothing of the connector's
  // machinery, its templates included: plan() is that, once per request.
  KVB_ASSIGN_OR_RETURN(Plan p, plan(mine, layouts, q));
  std::vector<PeerCopies> out(sources.size());
  for (size_t k = 0; k < sources.size(); ++k) out[k].pid = sources[k].pid;
  for (const Descriptor& d : p.descriptors) {
    out[d.source].local.push_back({memory[d.local_tensor].data() + d.local_offset, d.bytes});
    out[d.source].remote.push_back(
        {reinterpret_cast<void*>(sources[d.source].tensor_bases[d.remote_tensor] + d.remote_offset), d.bytes});
  }
  return out;
}

Result<std::vector<PeerCopies>> writes_of(const Layout& mine, std::span<const std::span<uint8_t>> memory,
                                          const std::vector<connector_internal::RemoteRankView>& targets,
                                          const std::vector<connector_internal::RemoteRankView>& own,
                                          const Request& q) {
  std::vector<Layout> layouts;
  for (const auto& r : own) layouts.push_back(r.layout);
  const uint32_t me = mine.rank();
  std::vector<PeerCopies> out(targets.size());
  for (size_t k = 0; k < targets.size(); ++k) {
    out[k].pid = targets[k].pid;
    KVB_ASSIGN_OR_RETURN(Plan p, plan(targets[k].layout, layouts, q));
    for (const Descriptor& x : p.descriptors) {
      if (x.source != me) continue;
      out[k].local.push_back({memory[x.remote_tensor].data() + x.remote_offset, x.bytes});
      out[k].remote.push_back(
          {reinterpret_cast<void*>(targets[k].tensor_bases[x.local_tensor] + x.local_offset), x.bytes});
    }
  }
  return out;
}

Result<TimedCopies> time_copies(const std::vector<PeerCopies>& copies, bool write) {
  const auto t0 = std::chrono::steady_clock::now();
  TimedCopies out;
  for (const PeerCopies& c : copies) {
    for (size_t i = 0; i < c.local.size(); i += IOV_MAX) {
      const unsigned long n = std::min<size_t>(IOV_MAX, c.local.size() - i);
      const ssize_t got = write ? ::process_vm_writev(c.pid, &c.local[i], n, &c.remote[i], n, 0)
                                : ::process_vm_readv(c.pid, &c.local[i], n, &c.remote[i], n, 0);
      if (got < 0) {
        return Status::io_error(
            std::string(write ? "raw process_vm_writev into pid " : "raw process_vm_readv from pid ") +
            std::to_string(c.pid) + ": " + std::strerror(errno));
      }
      out.bytes += static_cast<uint64_t>(got);
    }
  }
  out.us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  return out;
}

void CacheEvictor::evict() {
  constexpr size_t kBytes = size_t{64} << 20;
  if (buffer_.size() == 0) {
    // Huge pages, populated at once: 64 MiB faulted in 4 KiB at a time took
    // most of a small demo run's CPU on a virtual machine. Without memory
    // for it the baseline runs with warmer caches rather than not at all.
    Result<HostMemory> m = HostMemory::allocate(kBytes);
    if (!m.ok()) return;
    buffer_ = std::move(m).value();
    (void)buffer_.populate();
  }
  std::memset(buffer_.data(), static_cast<int>(++round_), buffer_.size());
  uint64_t sum = 0;
  for (size_t i = 0; i < buffer_.size(); i += 64) sum += buffer_.data()[i];
  volatile uint64_t sink = sum;
  (void)sink;
}

}  // namespace kvbridge::cli::demo

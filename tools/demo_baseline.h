// tools/demo_baseline.h: the demo's raw baseline, the kernel's own
// cross-process copy of a request's descriptors with no kvbridge code
// between, timed the way the load was timed.
//
// A pulling decode rank reads what its plan reads (process_vm_readv); in push
// mode a prefill rank writes what its writes moved (process_vm_writev). The
// report divides the library's throughput by this one's (`ratio`).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <span>
#include <vector>

#include "connector/worker_internal.h"
#include "kvbridge/host_memory.h"
#include "kvbridge/plan.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::demo {

// The copies between this process and one peer: local[i] to or from
// remote[i] in the peer's memory.
struct PeerCopies {
  int32_t pid = 0;
  std::vector<iovec> local, remote;
};

// A pulling rank's copies: its plan of `q` over `sources` (remote_ranks of
// the instance it reads from), each descriptor from its source rank into
// `memory` (this rank's registered tensors, in layout order).
Result<std::vector<PeerCopies>> reads_of(const Layout& mine, std::span<const std::span<uint8_t>> memory,
                                         const std::vector<connector_internal::RemoteRankView>& sources,
                                         const Request& q);

// A pushing prefill rank's copies: each target's plan of `q` over `own` (the
// ranks of this rank's instance), planned as that target plans it, and of it
// the descriptors this rank (`mine`) is the source of.
Result<std::vector<PeerCopies>> writes_of(const Layout& mine, std::span<const std::span<uint8_t>> memory,
                                          const std::vector<connector_internal::RemoteRankView>& targets,
                                          const std::vector<connector_internal::RemoteRankView>& own, const Request& q);

struct TimedCopies {
  uint64_t us = 0;
  uint64_t bytes = 0;
};

// Runs every peer's copies, IOV_MAX iovecs per syscall (process_vm_writev if
// `write`, else process_vm_readv), timed; the first failing call's errno is
// the error.
Result<TimedCopies> time_copies(const std::vector<PeerCopies>& copies, bool write);

// Writes and reads a buffer larger than the last-level cache, so that the
// baseline, like the load, reads its bytes from memory. The buffer is
// allocated on first use.
class CacheEvictor {
 public:
  void evict();

 private:
  HostMemory buffer_;
  uint8_t round_ = 0;
};

}  // namespace kvbridge::cli::demo

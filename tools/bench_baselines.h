// tools/bench_baselines.h: the measurements `kvbridge bench` compares the
// engine with. Each moves the same bytes as the engine row without the
// engine: memcpy (local; in cmd_bench.cc), raw process_vm_readv/writev with
// the same iovecs (cma), iperf3 single stream on loopback (tcp), and
// ucx_perftest (ucx, and UCX over TCP for the tcp row).
//
// The external tools are optional: a missing one is kUnavailable, saying so.
// Every child is bounded by timeout(1) and stopped by pid at the end.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <string>
#include <vector>

#include "bench.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::bench {

// process_vm_readv/writev of one transfer of a Workload, one iovec per
// descriptor (as given, not merged), at most IOV_MAX per call, on the calling
// thread: what a caller of the syscalls with the same descriptors does.
class RawCma {
 public:
  RawCma(pid_t pid, uint8_t* local_base, uint64_t remote_base, const Workload& workload);
  // One transfer k of the workload; false (errno kept) when a call failed or
  // moved fewer bytes than asked.
  bool run(bool read, uint64_t k) const;

 private:
  pid_t pid_;
  uint8_t* local_base_;
  uint64_t remote_base_;
  const Workload* workload_;  // not owned; outlives this
};

// iperf3 -s -1 on 127.0.0.1 and iperf3 -c for `seconds`, single stream: the
// receiver's bits per second, in Gbit/s.
Result<double> iperf3_gbps(uint32_t seconds);

// ucx_perftest server and client on 127.0.0.1: `test` (ucp_get, ucp_put_bw),
// message `size` bytes, `iterations`, with UCX_TLS=`tls` (empty: inherited).
// The client's final overall bandwidth (MB/s, 2^20 bytes) in Gbit/s.
Result<double> ucx_perftest_gbps(const std::string& test, uint64_t size, uint64_t iterations, const std::string& tls);
// ucp_put_lat (a ping-pong whose figure is half its round trip) as the
// throughput of one put with remote completion: `size` bytes per round trip.
// The baseline of a batch-1 write, which is one put and a flush.
Result<double> ucx_perftest_put_roundtrip_gbps(uint64_t size, uint64_t iterations, const std::string& tls);

}  // namespace kvbridge::cli::bench

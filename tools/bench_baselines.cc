// Baselines of `kvbridge bench`: raw cma, iperf3, ucx_perftest.
#include "bench_baselines.h"

#include <limits.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "bench_peer.h"

namespace kvbridge::cli::bench {

RawCma::RawCma(pid_t pid, uint8_t* local_base, uint64_t remote_base, const Workload& workload)
    : pid_(pid), local_base_(local_base), remote_base_(remote_base), workload_(&workload) {}

bool RawCma::run(bool read, uint64_t k) const {
  const std::span<const TransferItem> items = workload_->transfer(k);
  // Filling the iovecs costs a few ns per descriptor, against the ~0.1 µs
  // or more the kernel spends per iovec.
  iovec l[IOV_MAX], r[IOV_MAX];
  size_t done = 0;
  while (done < items.size()) {
    const size_t n = std::min<size_t>(IOV_MAX, items.size() - done);
    uint64_t want = 0;
    for (size_t i = 0; i < n; ++i) {
      const TransferItem& it = items[done + i];
      l[i] = iovec{local_base_ + it.local_offset, it.bytes};
      r[i] = iovec{reinterpret_cast<void*>(remote_base_ + it.remote_offset), it.bytes};
      want += it.bytes;
    }
    const ssize_t got = read ? ::process_vm_readv(pid_, l, n, r, n, 0) : ::process_vm_writev(pid_, l, n, r, n, 0);
    if (got != static_cast<ssize_t>(want)) return false;
    done += n;
  }
  return true;
}

Result<double> iperf3_gbps(uint32_t seconds) {
  if (!have_program("iperf3")) return Status::unavailable("iperf3 is not installed (Debian: iperf3)");
  const int port = free_port();
  if (port == 0) return Status::unavailable("no free TCP port for iperf3");
  const std::string p = std::to_string(port);
  KVB_ASSIGN_OR_RETURN(auto server, ShellChild::start("exec timeout " + std::to_string(seconds + 20) +
                                                      " iperf3 -s -1 -B 127.0.0.1 -p " + p));
  ShellOutput client;
  // The server needs a moment to listen; retry the client briefly.
  for (int attempt = 0; attempt < 20; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    client = run_shell("exec timeout " + std::to_string(seconds + 15) + " iperf3 -c 127.0.0.1 -p " + p + " -t " +
                       std::to_string(seconds) + " -J");
    if (client.ok) break;
    if (client.out.find("\"end\"") != std::string::npos) break;
  }
  server->wait_exit(std::chrono::milliseconds(3000));
  nlohmann::json j = nlohmann::json::parse(client.out, nullptr, false);
  if (j.is_discarded() || !j.contains("end")) return Status::io_error("iperf3 client produced no result");
  const nlohmann::json& end = j["end"];
  for (const char* key : {"sum_received", "sum_sent"}) {
    if (end.contains(key) && end[key].contains("bits_per_second"))
      return end[key]["bits_per_second"].get<double>() / 1e9;
  }
  return Status::io_error("iperf3 JSON has no end.sum_received.bits_per_second");
}

namespace {

// Runs a ucx_perftest server and client; the client's Final line as
// "iters lat50 lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall"
// (latencies in microseconds, bandwidths in MiB/s).
Result<std::array<double, 8>> ucx_perftest_final(const std::string& test, uint64_t size, uint64_t iterations,
                                                 const std::string& tls) {
  if (!have_program("ucx_perftest")) return Status::unavailable("ucx_perftest is not installed (Debian: ucx-utils)");
  const int port = free_port();
  if (port == 0) return Status::unavailable("no free TCP port for ucx_perftest");
  const std::string env = tls.empty() ? "" : "UCX_TLS=" + tls + " ";
  const std::string args = " -t " + test + " -s " + std::to_string(size) + " -n " + std::to_string(iterations) +
                           " -w " + std::to_string(std::max<uint64_t>(iterations / 10, 10)) + " -p " +
                           std::to_string(port);
  KVB_ASSIGN_OR_RETURN(auto server, ShellChild::start(env + "exec timeout 60 ucx_perftest" + args));
  ShellOutput client;
  for (int attempt = 0; attempt < 20; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    client = run_shell(env + "exec timeout 45 ucx_perftest 127.0.0.1" + args);
    if (client.out.find("Final:") != std::string::npos) break;
  }
  server->wait_exit(std::chrono::milliseconds(3000));
  // "Final: iters lat50 lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall"
  const size_t at = client.out.rfind("Final:");
  if (at == std::string::npos) return Status::io_error("ucx_perftest" + args + ": no Final line");
  std::istringstream words(client.out.substr(at + 6));
  std::array<double, 8> v{};
  for (double& x : v) words >> x;
  if (!words && v[5] == 0 && v[3] == 0)
    return Status::io_error("ucx_perftest" + args + ": cannot parse the Final line");
  return v;
}

}  // namespace

Result<double> ucx_perftest_gbps(const std::string& test, uint64_t size, uint64_t iterations, const std::string& tls) {
  KVB_ASSIGN_OR_RETURN(auto v, ucx_perftest_final(test, size, iterations, tls));
  if (v[5] <= 0) return Status::io_error("ucx_perftest -t " + test + ": no bandwidth in the Final line");
  return v[5] * 1048576.0 * 8 / 1e9;
}

Result<double> ucx_perftest_put_roundtrip_gbps(uint64_t size, uint64_t iterations, const std::string& tls) {
  KVB_ASSIGN_OR_RETURN(auto v, ucx_perftest_final("ucp_put_lat", size, iterations, tls));
  const double round_trip_us = 2 * v[3];  // lat_overall is half a round trip
  if (round_trip_us <= 0) return Status::io_error("ucx_perftest -t ucp_put_lat: no latency in the Final line");
  return static_cast<double>(size) * 8 / (round_trip_us * 1e3);
}

}  // namespace kvbridge::cli::bench

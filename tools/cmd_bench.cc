// `kvbridge bench`: the engine's throughput and per-transfer latency on every
// transport, next to a baseline measured in the same run (see bench.h for
// units and bench_peer.h for the second process).
//
// For each transport: one engine here offering only that transport, and a
// peer engine (another engine in this process for local; a `kvbridge bench
// peer` child process for cma, tcp and ucx). For each block size, pattern,
// batch and op, transfers of one batch are submitted and waited for one at a
// time until --min-time passes; that is one repetition, and the median of
// --reps is reported. The baseline of the row is measured right after, on the
// same descriptors: memcpy (local), process_vm_readv/writev (cma); iperf3
// (tcp) and ucx_perftest (ucx) once per run or per size.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <set>

#include "bench.h"
#include "bench_baselines.h"
#include "bench_peer.h"
#include "bench_report.h"
#include "cli.h"
#include "kvbridge/engine.h"

namespace kvbridge::cli {
namespace {

using namespace bench;

// Long enough for the largest transfer (256 MiB) on a slow link.
constexpr std::chrono::milliseconds kTransferTimeout{15000};

struct PeerArgs {
  std::string transport;
  uint64_t bytes = 0;
  uint32_t threads = 2;
  uint32_t tcp_streams = 4;
};

// A page-aligned, touched buffer.
struct Buffer {
  explicit Buffer(uint64_t bytes) : bytes(bytes) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, bytes) == 0) {
      std::memset(p, 0x3c, bytes);
      data = static_cast<uint8_t*>(p);
    }
  }
  ~Buffer() { std::free(data); }
  uint8_t* data = nullptr;
  uint64_t bytes;
};

Result<std::unique_ptr<Engine>> make_engine(const std::string& name, const std::string& transport,
                                            const BenchArgs& args) {
  EngineOptions o;
  o.name = name;
  o.transports = {transport};
  o.threads = args.threads;
  o.inline_bytes = args.inline_bytes;
  o.tcp_streams = args.tcp_streams;
  return Engine::create(o);
}

}  // namespace

namespace bench {

// The engine `engine` reaches the peer as `peer`; `local` is registered
// here as `local_region`, the peer's buffer is `remote_region` there.
Status measure(const std::string& transport, const BenchArgs& args, Engine& engine, PeerId peer, RegionId local_region,
               RegionId remote_region, const Baseline& baseline, std::vector<BenchRow>& rows, const Baseline* second) {
  for (uint64_t block : args.block_bytes) {
    for (const std::string& pattern : args.patterns) {
      std::set<uint64_t> done_batches;
      for (uint64_t batch : args.batches) {
        Workload w(args.buffer_bytes, block, pattern == "shuffled", batch, local_region, remote_region);
        if (!done_batches.insert(w.batch()).second) continue;  // capped to the same batch as before
        for (const std::string& op : args.ops) {
          const bool read = op == "read";
          Status error;
          auto once = [&](uint64_t k) {
            Result<TransferId> id = engine.submit(peer, read ? TransferOp::kRead : TransferOp::kWrite, w.transfer(k),
                                                  std::string(), kTransferTimeout);
            if (!id.ok()) {
              error = id.error();
              return false;
            }
            const TransferStatus st = engine.wait(*id, kTransferTimeout + std::chrono::seconds(5));
            (void)engine.release(*id);
            if (st.state != TransferState::kDone) {
              error = st.error.ok() ? Status::timeout("transfer did not end within its deadline") : st.error;
              return false;
            }
            return true;
          };
          const Timing t = time_median(once, args.min_seconds, args.reps);
          if (!t.ok) {
            return Status::io_error("bench: " + transport + " " + op + " block " + std::to_string(block) + " " +
                                    pattern + " batch " + std::to_string(w.batch()) + ": " + error.to_string());
          }
          BenchRow row;
          row.transport = transport;
          row.op = op;
          row.pattern = pattern;
          row.block_bytes = block;
          row.batch = w.batch();
          row.gbps = gbps(w.bytes_per_transfer(), t.seconds_per_call);
          row.latency_us = t.seconds_per_call * 1e6;
          row.baseline = baseline.row_name ? baseline.row_name(w, read) : baseline.name;
          if (baseline.once) {
            const Timing b =
                time_median([&](uint64_t k) { return baseline.once(w, read, k); }, args.min_seconds, args.reps);
            if (!b.ok) {
              return Status::io_error("bench: baseline " + baseline.name + " failed: " + std::strerror(errno));
            }
            row.baseline_gbps = gbps(w.bytes_per_transfer(), b.seconds_per_call);
          } else if (baseline.fixed_gbps) {
            row.baseline_gbps = baseline.fixed_gbps(w, read);
          }
          if (row.baseline_gbps > 0) row.ratio = row.gbps / row.baseline_gbps;
          if (second != nullptr && second->once) {
            const Timing b =
                time_median([&](uint64_t k) { return second->once(w, read, k); }, args.min_seconds, args.reps);
            if (!b.ok) return Status::io_error("bench: baseline " + second->name + " failed");
            row.per_copy_gbps = gbps(w.bytes_per_transfer(), b.seconds_per_call);
            if (row.per_copy_gbps > 0) row.per_copy_ratio = row.gbps / row.per_copy_gbps;
          }
          rows.push_back(row);
        }
      }
    }
  }
  return Status();
}

}  // namespace bench

namespace {

struct RunState {
  double iperf3_gbps = 0;
  double ucx_tcp_gbps = 0;
  std::map<std::pair<std::string, uint64_t>, double> ucx_perftest;  // (test, size) -> Gbit/s
};

Status bench_local(const BenchArgs& args, std::vector<BenchRow>& rows) {
  KVB_ASSIGN_OR_RETURN(auto here, make_engine("bench", "local", args));
  KVB_ASSIGN_OR_RETURN(auto there, make_engine("bench-peer", "local", args));
  Buffer local(args.buffer_bytes), remote(args.buffer_bytes);
  if (!local.data || !remote.data) return Status::resource_exhausted("bench: cannot allocate the buffers");
  KVB_ASSIGN_OR_RETURN(RegionId lr, here->register_memory(local.data, local.bytes));
  KVB_ASSIGN_OR_RETURN(RegionId rr, there->register_memory(remote.data, remote.bytes));
  KVB_ASSIGN_OR_RETURN(PeerId peer, here->connect(there->metadata()));
  Baseline memcpy_baseline{"memcpy",
                           [&](const Workload& w, bool read, uint64_t k) {
                             for (const TransferItem& it : w.transfer(k)) {
                               uint8_t* l = local.data + it.local_offset;
                               uint8_t* r = remote.data + it.remote_offset;
                               if (read) {
                                 std::memcpy(l, r, it.bytes);
                               } else {
                                 std::memcpy(r, l, it.bytes);
                               }
                             }
                             return true;
                           },
                           nullptr, nullptr};
  return measure("local", args, *here, peer, lr, rr, memcpy_baseline, rows);
}

Status bench_remote(const std::string& transport, const BenchArgs& args, RunState& state, std::vector<BenchRow>& rows) {
  KVB_ASSIGN_OR_RETURN(auto here, make_engine("bench", transport, args));
  Buffer local(args.buffer_bytes);
  if (!local.data) return Status::resource_exhausted("bench: cannot allocate the buffer");
  KVB_ASSIGN_OR_RETURN(RegionId lr, here->register_memory(local.data, local.bytes));
  KVB_ASSIGN_OR_RETURN(auto child, PeerProcess::spawn(transport, args.buffer_bytes, args.threads, args.tcp_streams));
  KVB_ASSIGN_OR_RETURN(PeerId peer, here->connect(child->metadata()));

  Baseline baseline;
  if (transport == "cma") {
    baseline.name = "process_vm_rw";
    baseline.once = [&](const Workload& w, bool read, uint64_t k) {
      return RawCma(child->pid(), local.data, child->buffer_address(), w).run(read, k);
    };
  } else if (transport == "tcp") {
    if (state.iperf3_gbps > 0) {
      baseline.name = "iperf3";
      baseline.fixed_gbps = [&](const Workload&, bool) { return state.iperf3_gbps; };
    }
  } else if (transport == "ucx") {
    const char* tls_env = std::getenv("UCX_TLS");
    const std::string tls = tls_env ? tls_env : "";
    // Per row, the ucx_perftest test that does what the row does: reads are
    // ucp_get; a batch of writes is a stream of puts (ucp_put_bw); a batch
    // of one write is one put and its remote completion, a round trip, which
    // ucp_put_bw's pipelined stream never waits for: ucp_put_lat's round trip.
    struct PerftestTest {
      const char* test;  // the ucx_perftest -t argument
      const char* row;   // the row's baseline name
    };
    auto perftest_for = [](const Workload& w, bool read) {
      if (read) return PerftestTest{"ucp_get", "perftest:get"};
      return w.batch() == 1 ? PerftestTest{"ucp_put_lat", "perftest:put_rtt"}
                            : PerftestTest{"ucp_put_bw", "perftest:put_bw"};
    };
    baseline.name = "ucx_perftest";
    baseline.row_name = [perftest_for](const Workload& w, bool read) -> std::string {
      return perftest_for(w, read).row;
    };
    baseline.fixed_gbps = [&, tls, perftest_for](const Workload& w, bool read) {
      const std::string test = perftest_for(w, read).test;
      const auto key = std::make_pair(test, w.block_bytes());
      auto it = state.ucx_perftest.find(key);
      if (it != state.ucx_perftest.end()) return it->second;
      const uint64_t budget = args.quick ? (uint64_t{32} << 20) : (uint64_t{512} << 20);
      const uint64_t iterations = std::clamp<uint64_t>(budget / w.block_bytes(), 100, 20000);
      Result<double> g = test == "ucp_put_lat" ? ucx_perftest_put_roundtrip_gbps(w.block_bytes(), iterations, tls)
                                               : ucx_perftest_gbps(test, w.block_bytes(), iterations, tls);
      if (!g.ok()) std::cerr << "bench: ucx baseline: " << g.error().to_string() << "\n";
      return state.ucx_perftest[key] = g.ok() ? *g : 0.0;
    };
  }
  return measure(transport, args, *here, peer, lr, child->region(), baseline, rows);
}

int run_bench(BenchArgs args) {
  if (args.quick) {
    args.buffer_bytes = std::min<uint64_t>(args.buffer_bytes, uint64_t{8} << 20);
    args.min_seconds = std::min(args.min_seconds, 0.005);
    args.reps = std::min<uint32_t>(args.reps, 3);
    args.iperf_seconds = 1;
  }
  std::vector<BenchRow> rows;
  RunState state;
  if (args.memory == "cuda") {
    // Device memory: the cuda_ipc rows only, 2 KiB to 2 MiB blocks unless
    // asked otherwise.
    if (args.block_bytes == BenchArgs{}.block_bytes) args.block_bytes = {2048, 16384, 65536, 262144, 2097152};
    const auto start = std::chrono::steady_clock::now();
    Status s = bench_device(args, rows);
    if (!s.ok()) return fail(s);
    std::cerr << "bench: cuda_ipc: " << rows.size() << " rows in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s\n";
    args.transports.clear();
  }
  // The ucx target compares the engine with ucx_perftest "for the same
  // transport": left to itself, perftest picks shared memory and copies one
  // cache-hot buffer. Pin one UCX transport for the engine, its peer process
  // and perftest alike (before any thread or UCX context exists).
  bool pinned_ucx_tls = false;
  if (std::find(args.transports.begin(), args.transports.end(), "ucx") != args.transports.end() &&
      std::getenv("UCX_TLS") == nullptr) {
    ::setenv("UCX_TLS", "tcp", 1);
    pinned_ucx_tls = true;
  }
  const bool want_tcp = std::find(args.transports.begin(), args.transports.end(), "tcp") != args.transports.end();
  if (want_tcp) {
    // External baselines first, while nothing of ours runs.
    Result<double> iperf = iperf3_gbps(args.iperf_seconds);
    if (iperf.ok()) {
      state.iperf3_gbps = *iperf;
    } else {
      std::cerr << "bench: tcp baseline skipped: " << iperf.error().message() << "\n";
    }
    Result<double> ucx = ucx_perftest_gbps("ucp_get", 1 << 20, args.quick ? 100 : 1000, "tcp");
    if (ucx.ok()) {
      state.ucx_tcp_gbps = *ucx;
    } else {
      std::cerr << "bench: UCX-over-TCP comparison skipped: " << ucx.error().message() << "\n";
    }
  }
  int skipped = 0;
  for (const std::string& t : args.transports) {
    const auto start = std::chrono::steady_clock::now();
    const size_t before = rows.size();
    Status s = t == "local" ? bench_local(args, rows) : bench_remote(t, args, state, rows);
    if (!s.ok()) {
      // Unavailable (ucx not built, cma refused by ptrace policy): a reason, not a failure.
      if (s.code() != Code::kUnavailable) return fail(s);
      std::cerr << "bench: " << t << " skipped: " << s.message() << "\n";
      ++skipped;
      continue;
    }
    std::cerr << "bench: " << t << ": " << rows.size() - before << " rows in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s\n";
  }
  for (BenchRow& r : rows) {
    if (r.transport != "tcp" || state.ucx_tcp_gbps <= 0) continue;
    r.ucx_tcp_gbps = state.ucx_tcp_gbps;
    r.ucx_tcp_ratio = r.gbps / state.ucx_tcp_gbps;
  }
  if (args.json) {
    std::cout << rows_json(rows) << "\n";
  } else {
    std::cout << "kvbridge bench: Gbit/s = 10^9 bit/s; latency = one submit() + wait(); median of " << args.reps
              << " x " << args.min_seconds << " s; buffer " << (args.buffer_bytes >> 20)
              << " MiB per side; engine threads " << args.threads << ", inline_bytes " << args.inline_bytes
              << ", baselines single-threaded\n";
    if (state.iperf3_gbps > 0) std::cout << "iperf3 single stream, loopback: " << state.iperf3_gbps << " Gbit/s\n";
    if (state.ucx_tcp_gbps > 0)
      std::cout << "ucx_perftest ucp_get UCX_TLS=tcp 1 MiB: " << state.ucx_tcp_gbps << " Gbit/s\n";
    if (pinned_ucx_tls) {
      std::cout << "ucx rows: UCX_TLS=tcp for the engine, its peer and ucx_perftest (UCX_TLS was unset; set it to "
                   "measure another UCX transport)\n";
    }
    if (!state.ucx_perftest.empty()) {
      std::cout << "ucx baselines: perftest:get = ucx_perftest -t ucp_get; perftest:put_bw = -t ucp_put_bw (a "
                   "stream of puts, for batches); perftest:put_rtt = -t ucp_put_lat's round trip (one put and its "
                   "remote completion, as a batch of one write is)\n";
      std::cout << "note: ucx_perftest moves one buffer of the message size again and again (cache-hot); the engine "
                   "walks a "
                << (args.buffer_bytes >> 20)
                << " MiB buffer, so for blocks that fit in cache the ucx ratio is pessimistic\n";
    }
    if (args.memory == "cuda") {
      std::cout << "device rows: device memory on both sides, " << device_description()
                << "; baseline = one cudaMemcpy of the transfer's bytes, contiguous, on the same device; per_copy = "
                   "one cudaMemcpyAsync per descriptor on one stream\n";
    }
    print_table(std::cout, rows);
    print_targets(std::cout, rows, state.iperf3_gbps, state.ucx_tcp_gbps);
  }
  if (!args.plot.empty()) {
    Status s = plot_png(rows, args.plot);
    if (!s.ok()) return fail(s);
    std::cerr << "bench: chart written to " << args.plot << "\n";
  }
  if (rows.empty())
    return fail(Status::unavailable("bench: no transport could run (" + std::to_string(skipped) + " skipped)"));
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& root) {
  auto args = std::make_shared<BenchArgs>();
  auto peer = std::make_shared<PeerArgs>();
  CLI::App* app = root.add_subcommand("bench", "Measure the engine's throughput and latency against baselines");
  app->require_subcommand(0, 1);  // the root's "exactly one" is inherited; `peer` is optional
  app->add_option("--transport", args->transports,
                  "Transports to measure (local, cma, tcp, ucx; cuda_ipc: --memory cuda)")
      ->check(CLI::IsMember({"local", "cma", "tcp", "ucx"}))
      ->capture_default_str();
  app->add_option("--block-bytes", args->block_bytes, "Block sizes in bytes")->check(positive())->capture_default_str();
  app->add_option("--batch", args->batches, "Descriptors per transfer")->check(positive())->capture_default_str();
  app->add_option("--pattern", args->patterns, "Block id patterns")
      ->check(CLI::IsMember({"contiguous", "shuffled"}))
      ->capture_default_str();
  app->add_option("--op", args->ops, "Operations")->check(CLI::IsMember({"read", "write"}))->capture_default_str();
  app->add_option("--buffer-bytes", args->buffer_bytes, "Buffer per side")
      ->check(CLI::Range(uint64_t{4096}, uint64_t{1} << 36))
      ->capture_default_str();
  app->add_option("--min-time", args->min_seconds, "Seconds per repetition")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--reps", args->reps, "Repetitions; the median is reported")
      ->check(positive())
      ->capture_default_str();
  app->add_option("--threads", args->threads, "Engine worker threads")->check(positive())->capture_default_str();
  app->add_option("--inline-bytes", args->inline_bytes,
                  "EngineOptions::inline_bytes: local/cma transfers up to this size run inside submit() (0: never)")
      ->capture_default_str();
  app->add_option("--tcp-streams", args->tcp_streams, "tcp connections per peer")
      ->check(positive())
      ->capture_default_str();
  app->add_option("--iperf-seconds", args->iperf_seconds, "iperf3 run length")
      ->check(positive())
      ->capture_default_str();
  app->add_flag("--quick", args->quick,
                "Short run (8 MiB buffers, 5 ms x 3 repetitions): a smoke test, not a measurement");
  app->add_flag("--json", args->json, "Print one JSON array of rows instead of the table");
  app->add_option("--memory", args->memory,
                  "host: the transports' rows; cuda: cuda_ipc between device memory of two processes, against "
                  "cudaMemcpy and one cudaMemcpyAsync per descriptor")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  app->add_option("--device-copy", args->device_copies, "--memory cuda: the copy methods to measure")
      ->check(CLI::IsMember({"copy_engine", "kernel"}))
      ->capture_default_str();
  app->add_option("--plot", args->plot, "Write a PNG chart (gnuplot) to this file");
  // The hidden peer process (bench_peer.h); started by the bench itself.
  CLI::App* peer_app = app->add_subcommand("peer", "The bench's peer process (internal)");
  peer_app->group("");
  peer_app->add_option("--transport", peer->transport)->required();
  peer_app->add_option("--bytes", peer->bytes)->required();
  peer_app->add_option("--threads", peer->threads);
  peer_app->add_option("--tcp-streams", peer->tcp_streams);
  return Command{app, [args, peer, peer_app] {
                   if (peer_app->parsed())
                     return run_bench_peer(peer->transport, peer->bytes, peer->threads, peer->tcp_streams);
                   return run_bench(*args);
                 }};
}

}  // namespace kvbridge::cli

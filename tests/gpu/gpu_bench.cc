// gpu_bench: the device check's figures (scripts/gpu-check.sh), each row's
// bytes checked after its copy and a verdict per row.
//
// Cases (device memory of device 0, descriptors shuffled as a P/D load's
// blocks are): 10k x 2 KiB, 10k x 16 KiB, 1k x 256 KiB, 10k x 16 KiB with
// every descriptor misaligned by 1..15 bytes, one descriptor of 80 MiB.
// Each case is copied by
//   contiguous      one cudaMemcpy of the same bytes in one piece (the ceiling)
//   per_descriptor  one cudaMemcpyAsync per descriptor (what connectors post)
//   batch           one raw cudaMemcpyBatchAsync of the descriptors
//   kernel          the gather/scatter kernel (device/gather.h)
//   engine/<method> a transfer of the engine, local transport, each method
//   ipc/<method>    a transfer over cuda_ipc from a child process (gpu_bench
//                   --peer), for 10k x 16 KiB
// and host <-> device of registered (pinned) host KV against cudaMemcpy of
// the same pinned bytes; then a slow producer (a kernel that writes the
// source late, its event handed to the transfer) 50 times, exact each time;
// then device memory over tcp on loopback, staged through pinned host memory
// (tcp/staged), with its two legs as baselines in the same run (pinned_d2h,
// tcp/host; xcontig is then against the slower of the two).
//
// Every row: median seconds of --reps runs, GB/s, ratios to the baselines of
// the same case, wrong bytes, and PASS/FAIL: FAIL on any wrong byte, and
// against the targets on a real device (the fake's figures are host
// memory's, so only its bytes are judged). Then the crossover for
// device_copy "auto" (the largest copy size at which the kernel beat the
// copy engines). JSON of every row to --json FILE; the last line is the
// verdict.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/child_process.h"
#include "conformance/pattern.h"
#include "device/device.h"
#include "kvbridge/engine.h"

namespace kvbridge {
namespace {

using Clock = std::chrono::steady_clock;
using conformance::from_hex;
using conformance::to_hex;

device::Device& dev() { return device::current(); }

struct Case {
  std::string name;
  uint64_t count = 0, bytes = 0;  // descriptors and bytes each
  bool misaligned = false;
  bool ipc = false;  // also over cuda_ipc
};

struct Row {
  std::string case_name, method;
  double seconds = 0, gbps = 0;
  double vs_contiguous = 0, vs_per_descriptor = 0, vs_batch = 0;
  uint64_t wrong = 0;
  std::string target;  // "" when none
  bool pass = true;
  std::string why;
};

bool await(device::Event e) {
  const auto end = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < end) {
    Result<bool> d = dev().done(e);
    if (!d.ok()) return false;
    if (*d) return true;
    std::this_thread::yield();
  }
  return false;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The descriptors of a case: source i at a slot of `src`, destination at a
// shuffled slot of `dst`; misaligned cases shift both by 1..15 bytes.
struct Layout {
  std::vector<uint64_t> src_off, dst_off;
  uint64_t span = 0;  // bytes each buffer needs
};

Layout layout_of(const Case& c, std::mt19937_64& rng) {
  Layout l;
  const uint64_t slot = c.bytes + (c.misaligned ? 16 : 0);
  std::vector<uint64_t> order(c.count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (uint64_t i = 0; i < c.count; ++i) {
    const uint64_t shift = c.misaligned ? 1 + i % 15 : 0;
    l.src_off.push_back(i * slot + shift);
    l.dst_off.push_back(order[i] * slot + (c.misaligned ? 15 - i % 15 : 0));
  }
  l.span = c.count * slot;
  return l;
}

class Bench {
 public:
  Bench(int reps, std::string peer_path) : reps_(reps), peer_path_(std::move(peer_path)) {}

  Status run_case(const Case& c, std::vector<Row>* rows) {
    std::mt19937_64 rng(c.count * 31 + c.bytes);
    const Layout l = layout_of(c, rng);
    KVB_ASSIGN_OR_RETURN(void* s, dev().allocate(0, l.span));
    KVB_ASSIGN_OR_RETURN(void* t, dev().allocate(0, l.span));
    src_ = static_cast<uint8_t*>(s);
    dst_ = static_cast<uint8_t*>(t);
    std::vector<uint8_t> host(l.span);
    conformance::fill_pattern(host.data(), l.span, 5, 0);
    KVB_RETURN_IF_ERROR(dev().copy_sync(src_, host.data(), l.span));
    std::vector<device::DeviceCopy> copies;
    for (uint64_t i = 0; i < c.count; ++i) copies.push_back({dst_ + l.dst_off[i], src_ + l.src_off[i], c.bytes});
    KVB_ASSIGN_OR_RETURN(device::Stream stream, dev().create_stream(0));
    KVB_ASSIGN_OR_RETURN(device::Event event, dev().create_event(0, false));
    const uint64_t total = c.count * c.bytes;

    auto check = [&]() -> uint64_t {
      std::vector<uint8_t> back(l.span);
      if (!dev().copy_sync(back.data(), dst_, l.span).ok()) return total;
      uint64_t wrong = 0;
      for (uint64_t i = 0; i < c.count; ++i) {
        const uint8_t* want = host.data() + l.src_off[i];
        const uint8_t* got = back.data() + l.dst_off[i];
        if (std::memcmp(want, got, c.bytes) != 0) {
          for (uint64_t k = 0; k < c.bytes; ++k) wrong += want[k] != got[k];
        }
      }
      return wrong;
    };
    auto clear = [&]() { (void)dev().copy_sync(dst_, std::vector<uint8_t>(l.span, 0).data(), l.span); };
    // Times `once` (which queues work on `stream` or runs it whole) `reps_`
    // times after a warm-up; then checks the bytes (unless contiguous).
    auto time = [&](const std::string& method, const std::function<bool()>& once, bool checked) -> Row {
      Row r;
      r.case_name = c.name;
      r.method = method;
      clear();
      std::vector<double> runs;
      bool ok = once();
      for (int i = 0; ok && i < reps_; ++i) {
        const auto t0 = Clock::now();
        ok = once();
        runs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      r.seconds = median(runs);
      r.gbps = r.seconds > 0 ? total / r.seconds / 1e9 : 0;
      if (!ok) {
        r.pass = false;
        r.why = "the copy failed";
      }
      if (checked) r.wrong = check();
      if (r.wrong > 0) {
        r.pass = false;
        r.why = std::to_string(r.wrong) + " wrong bytes";
      }
      return r;
    };
    auto on_stream = [&](const std::function<Status()>& queue) {
      return [&, queue]() { return queue().ok() && dev().record(event, stream).ok() && await(event); };
    };

    Row contiguous = time(
        "contiguous", [&] { return dev().copy_sync(dst_, src_, total).ok(); }, false);
    Row per = time("per_descriptor", on_stream([&] { return dev().copy_each(stream, copies); }), true);
    Row batch =
        time("batch", on_stream([&] { return dev().copy(stream, copies, device::CopyMethod::kCopyEngine); }), true);
    Row kernel =
        time("kernel", on_stream([&] { return dev().copy(stream, copies, device::CopyMethod::kKernel); }), true);
    std::vector<Row> engine_rows;
    for (const char* method : {"copy_engine", "kernel"}) {
      engine_rows.push_back(engine_row(c, l, method, time));
      if (c.ipc) engine_rows.push_back(ipc_row(c, l, method, time));
    }
    for (Row* r : {&contiguous, &per, &batch, &kernel}) rows->push_back(*r);
    for (Row& r : engine_rows) rows->push_back(r);
    for (auto it = rows->end() - static_cast<long>(4 + engine_rows.size()); it != rows->end(); ++it) {
      if (it->seconds > 0) {
        it->vs_contiguous = contiguous.seconds / it->seconds;
        it->vs_per_descriptor = per.seconds / it->seconds;
        it->vs_batch = batch.seconds / it->seconds;
      }
      judge(c, *it);
    }
    dev().destroy_event(event);
    dev().destroy_stream(stream);
    KVB_RETURN_IF_ERROR(dev().free(src_));
    KVB_RETURN_IF_ERROR(dev().free(dst_));
    return Status();
  }

  // Registered (pinned) host KV to and from the device by the engine's local
  // transport, against cudaMemcpy of the same pinned bytes.
  Status host_rows(std::vector<Row>* rows) {
    const uint64_t bytes = uint64_t{256} << 20;
    std::vector<uint8_t> host(bytes);
    conformance::fill_pattern(host.data(), bytes, 3, 0);
    KVB_ASSIGN_OR_RETURN(void* d, dev().allocate(0, bytes));
    auto a = make_engine("host", "copy_engine");
    auto b = make_engine("device", "copy_engine");
    if (!a || !b) return Status::internal("no engine");
    KVB_ASSIGN_OR_RETURN(RegionId rh, a->register_memory(host.data(), bytes, "host"));
    KVB_ASSIGN_OR_RETURN(RegionId rd, b->register_memory(d, bytes, "cuda:0"));
    KVB_ASSIGN_OR_RETURN(PeerId peer, a->connect(b->metadata()));
    for (TransferOp op : {TransferOp::kWrite, TransferOp::kRead}) {
      const std::string dir = op == TransferOp::kWrite ? "host_to_device" : "device_to_host";
      std::vector<double> base, mine;
      for (int i = 0; i <= reps_; ++i) {
        auto t0 = Clock::now();
        const Status s =
            op == TransferOp::kWrite ? dev().copy_sync(d, host.data(), bytes) : dev().copy_sync(host.data(), d, bytes);
        if (i > 0) base.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        KVB_RETURN_IF_ERROR(s);
        const TransferItem all{rh, 0, rd, 0, bytes};
        t0 = Clock::now();
        KVB_ASSIGN_OR_RETURN(TransferId t, a->submit(peer, op, {&all, 1}));
        const TransferStatus st = a->wait(t, std::chrono::seconds(30));
        if (i > 0) mine.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        if (st.state != TransferState::kDone) return st.error;
      }
      Row r;
      r.case_name = "pinned_256MiB";
      r.method = dir;
      r.seconds = median(mine);
      r.gbps = bytes / r.seconds / 1e9;
      r.vs_contiguous = median(base) / r.seconds;
      std::vector<uint8_t> back(bytes);
      KVB_RETURN_IF_ERROR(dev().copy_sync(back.data(), d, bytes));
      std::vector<uint8_t> want(bytes);
      conformance::fill_pattern(want.data(), bytes, 3, 0);
      r.wrong = static_cast<uint64_t>(conformance::find_mismatch(back.data(), bytes, 3, 0) < 0 ? 0 : 1);
      if (r.wrong > 0 || host != want) {
        r.pass = false;
        r.why = "wrong bytes";
      }
      if (real()) {
        r.target = ">= 0.8x cudaMemcpy of pinned memory";
        if (r.vs_contiguous < 0.8) r.pass = false, r.why = "below its target";
      }
      rows->push_back(r);
    }
    a.reset();
    b.reset();
    return dev().free(d);
  }

  // A slow producer: the source is written by a kernel that waits first,
  // its event handed to the transfer; 50 times, every byte the new one.
  Status producer_row(std::vector<Row>* rows) {
    const uint64_t bytes = uint64_t{4} << 20;
    KVB_ASSIGN_OR_RETURN(void* s, dev().allocate(0, bytes));
    KVB_ASSIGN_OR_RETURN(void* t, dev().allocate(0, bytes));
    auto a = make_engine("reader", "kernel");
    auto b = make_engine("producer", "kernel");
    KVB_ASSIGN_OR_RETURN(RegionId rs, b->register_memory(s, bytes, "cuda:0"));
    KVB_ASSIGN_OR_RETURN(RegionId rt, a->register_memory(t, bytes, "cuda:0"));
    KVB_ASSIGN_OR_RETURN(PeerId peer, a->connect(b->metadata()));
    KVB_ASSIGN_OR_RETURN(device::Stream stream, dev().create_stream(0));
    KVB_ASSIGN_OR_RETURN(device::Event ready, dev().create_event(0, true));
    KVB_ASSIGN_OR_RETURN(std::string handle, dev().export_event(ready));
    Row r;
    r.case_name = "slow_producer_x50";
    r.method = "engine/kernel";
    std::vector<uint8_t> back(bytes);
    const auto t0 = Clock::now();
    for (int i = 0; i < 50; ++i) {
      const uint8_t value = static_cast<uint8_t>(i * 7 + 1);
      KVB_RETURN_IF_ERROR(dev().fill_after(stream, s, bytes, value, std::chrono::microseconds(2000)));
      KVB_RETURN_IF_ERROR(dev().record(ready, stream));
      SubmitOptions o;
      o.ready_event_handles = {handle};
      const TransferItem all{rt, 0, rs, 0, bytes};
      KVB_ASSIGN_OR_RETURN(TransferId id, a->submit(peer, TransferOp::kRead, {&all, 1}, o));
      const TransferStatus st = a->wait(id, std::chrono::seconds(30));
      if (st.state != TransferState::kDone) return st.error;
      KVB_RETURN_IF_ERROR(dev().copy_sync(back.data(), t, bytes));
      r.wrong += static_cast<uint64_t>(std::count_if(back.begin(), back.end(), [&](uint8_t x) { return x != value; }));
    }
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count() / 50;
    r.target = "exact every time";
    if (r.wrong > 0) r.pass = false, r.why = std::to_string(r.wrong) + " stale bytes";
    rows->push_back(r);
    dev().destroy_event(ready);
    dev().destroy_stream(stream);
    a.reset();
    b.reset();
    KVB_RETURN_IF_ERROR(dev().free(s));
    return dev().free(t);
  }

  // Device memory over tcp on loopback, staged through pinned host memory
  // on both sides (`count` shuffled descriptors of 16 KiB), against the
  // slower of its two legs measured in the same run: a pinned
  // device-to-host cudaMemcpy of the same bytes, and tcp moving the same
  // descriptors between host memory.
  Status staged_rows(uint64_t count, std::vector<Row>* rows) {
    const Case c{"staged_" + std::to_string(count) + "_x_16KiB", count, 16384, false, false};
    std::mt19937_64 rng(count * 17 + 3);
    const Layout l = layout_of(c, rng);
    const uint64_t total = c.count * c.bytes;
    std::vector<uint8_t> host_src(l.span), host_dst(l.span, 0), pinned(l.span);
    conformance::fill_pattern(host_src.data(), l.span, 9, 0);
    KVB_ASSIGN_OR_RETURN(void* ds, dev().allocate(0, l.span));
    KVB_ASSIGN_OR_RETURN(void* dd, dev().allocate(0, l.span));
    KVB_RETURN_IF_ERROR(dev().copy_sync(ds, host_src.data(), l.span));
    KVB_RETURN_IF_ERROR(dev().copy_sync(dd, host_dst.data(), l.span));
    // The bytes of every descriptor where it landed.
    auto wrong_in = [&](const uint8_t* got) {
      uint64_t wrong = 0;
      for (uint64_t i = 0; i < c.count; ++i) {
        const uint8_t* want = host_src.data() + l.src_off[i];
        const uint8_t* at = got + l.dst_off[i];
        if (std::memcmp(want, at, c.bytes) != 0) {
          for (uint64_t k = 0; k < c.bytes; ++k) wrong += want[k] != at[k];
        }
      }
      return wrong;
    };
    auto timed = [&](const std::function<Status()>& once, double* seconds) -> Status {
      std::vector<double> runs;
      for (int i = 0; i <= reps_; ++i) {
        const auto t0 = Clock::now();
        KVB_RETURN_IF_ERROR(once());
        if (i > 0) runs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      *seconds = median(runs);
      return Status();
    };
    // Leg 1: device to pinned host memory, one copy.
    double d2h = 0;
    KVB_RETURN_IF_ERROR(dev().register_host(pinned.data(), l.span));
    Status leg = timed([&] { return dev().copy_sync(pinned.data(), ds, total); }, &d2h);
    KVB_RETURN_IF_ERROR(dev().unregister_host(pinned.data()));
    KVB_RETURN_IF_ERROR(leg);
    // A read of the descriptors by one tcp engine from another, on loopback.
    auto over_tcp = [&](void* to, void* from, const char* memory, double* seconds) -> Status {
      auto a = make_engine("staged-reader", "copy_engine", {"tcp"});
      auto b = make_engine("staged-source", "copy_engine", {"tcp"});
      if (!a || !b) return Status::internal("no tcp engine");
      KVB_ASSIGN_OR_RETURN(RegionId rd, a->register_memory(to, l.span, memory));
      KVB_ASSIGN_OR_RETURN(RegionId rs, b->register_memory(from, l.span, memory));
      KVB_ASSIGN_OR_RETURN(PeerId peer, a->connect(b->metadata()));
      std::vector<TransferItem> items;
      for (uint64_t i = 0; i < c.count; ++i) items.push_back({rd, l.dst_off[i], rs, l.src_off[i], c.bytes});
      return timed(
          [&]() -> Status {
            KVB_ASSIGN_OR_RETURN(TransferId t, a->submit(peer, TransferOp::kRead, items));
            const TransferStatus st = a->wait(t, std::chrono::seconds(60));
            (void)a->release(t);
            return st.state == TransferState::kDone ? Status() : st.error;
          },
          seconds);
    };
    double tcp_host = 0, staged = 0;
    KVB_RETURN_IF_ERROR(over_tcp(host_dst.data(), host_src.data(), "host", &tcp_host).with_context("tcp host"));
    KVB_RETURN_IF_ERROR(over_tcp(dd, ds, "cuda:0", &staged).with_context("tcp staged"));
    std::vector<uint8_t> back(l.span);
    KVB_RETURN_IF_ERROR(dev().copy_sync(back.data(), dd, l.span));
    const double slower_leg = std::max(d2h, tcp_host);
    auto row = [&](const std::string& method, double seconds, uint64_t wrong) {
      Row r;
      r.case_name = c.name;
      r.method = method;
      r.seconds = seconds;
      r.gbps = seconds > 0 ? total / seconds / 1e9 : 0;
      r.vs_contiguous = seconds > 0 ? slower_leg / seconds : 0;
      r.wrong = wrong;
      if (wrong > 0) r.pass = false, r.why = std::to_string(wrong) + " wrong bytes";
      return r;
    };
    rows->push_back(row("pinned_d2h", d2h, 0));
    rows->push_back(row("tcp/host", tcp_host, wrong_in(host_dst.data())));
    Row r = row("tcp/staged", staged, wrong_in(back.data()));
    if (real()) {
      r.target = ">= 0.8x the slower of pinned D2H and tcp/host";
      if (r.wrong == 0 && r.vs_contiguous < 0.8) r.pass = false, r.why = "below its target";
    }
    rows->push_back(r);
    KVB_RETURN_IF_ERROR(dev().free(ds));
    return dev().free(dd);
  }

  static bool real() { return dev().name() != "fake"; }

 private:
  std::unique_ptr<Engine> make_engine(const std::string& name, const std::string& method,
                                      std::vector<std::string> transports = {"local"}) {
    EngineOptions o;
    o.name = name;
    o.transports = std::move(transports);
    o.device_copy = method;
    Result<std::unique_ptr<Engine>> e = Engine::create(o);
    if (!e.ok()) std::cerr << "engine: " << e.error().to_string() << "\n";
    return e.ok() ? std::move(*e) : nullptr;
  }

  template <class Time>
  Row engine_row(const Case& c, const Layout& l, const std::string& method, Time& time) {
    auto a = make_engine("bench", method);
    auto b = make_engine("peer", method);
    Row failed;
    failed.case_name = c.name;
    failed.method = "engine/" + method;
    failed.pass = false;
    if (!a || !b) return failed.why = "no engine", failed;
    Result<RegionId> rd = a->register_memory(dst_, l.span, "cuda:0");
    Result<RegionId> rs = b->register_memory(src_, l.span, "cuda:0");
    Result<PeerId> peer = rd.ok() && rs.ok() ? a->connect(b->metadata()) : Result<PeerId>(Status::internal("reg"));
    if (!peer.ok()) return failed.why = peer.error().to_string(), failed;
    std::vector<TransferItem> items;
    for (uint64_t i = 0; i < c.count; ++i) items.push_back({*rd, l.dst_off[i], *rs, l.src_off[i], c.bytes});
    return time(
        "engine/" + method,
        [&] {
          Result<TransferId> t = a->submit(*peer, TransferOp::kRead, items);
          return t.ok() && a->wait(*t, std::chrono::seconds(30)).state == TransferState::kDone;
        },
        true);
  }

  // The same read from a child process's copy of the source over cuda_ipc.
  template <class Time>
  Row ipc_row(const Case& c, const Layout& l, const std::string& method, Time& time) {
    Row failed;
    failed.case_name = c.name;
    failed.method = "ipc/" + method;
    failed.pass = false;
    SpawnOptions so;
    so.pipe_stdin = so.pipe_stdout = so.inherit_stderr = true;
    Result<std::unique_ptr<ChildProcess>> child =
        ChildProcess::spawn({peer_path_, "--peer", std::to_string(l.span)}, so);
    if (!child.ok()) return failed.why = child.error().to_string(), failed;
    const std::string ready = (*child)->read_line(std::chrono::seconds(30));
    std::istringstream in(ready);
    std::string word, hex;
    RegionId remote = 0;
    in >> word >> remote >> hex;
    if (word != "ready") return failed.why = "peer: " + ready, failed;
    auto a = make_engine("bench", method, {"cuda_ipc"});
    Result<RegionId> rd = a ? a->register_memory(dst_, l.span, "cuda:0") : Result<RegionId>(Status::internal("e"));
    Result<PeerId> peer = rd.ok() ? a->connect(from_hex(hex)) : Result<PeerId>(rd.error());
    if (!peer.ok()) return failed.why = peer.error().to_string(), failed;
    std::vector<TransferItem> items;
    for (uint64_t i = 0; i < c.count; ++i) items.push_back({*rd, l.dst_off[i], remote, l.src_off[i], c.bytes});
    // The child's source holds the same pattern as this process's.
    Row r = time(
        "ipc/" + method,
        [&] {
          Result<TransferId> t = a->submit(*peer, TransferOp::kRead, items);
          return t.ok() && a->wait(*t, std::chrono::seconds(30)).state == TransferState::kDone;
        },
        true);
    const std::string bye = "exit\n";
    (void)!::write((*child)->stdin_fd(), bye.data(), bye.size());
    (*child)->wait(std::chrono::seconds(10));
    return r;
  }

  // The targets: only on a real device, where the figures are a GPU's.
  static void judge(const Case& c, Row& r) {
    if (!real()) return;
    const bool ours = r.method == "kernel" || r.method.rfind("ipc/", 0) == 0 || r.method.rfind("engine/", 0) == 0;
    if (!ours) return;
    if (c.name == "10k_x_16KiB" && r.method.find("kernel") != std::string::npos) {
      r.target = ">= 0.7x contiguous";
      if (r.vs_contiguous < 0.7) r.pass = false, r.why = "below its target";
    }
    if (c.name == "10k_x_2KiB" && r.method == "kernel") {
      r.target = ">= 20x per_descriptor";
      if (r.vs_per_descriptor < 20) r.pass = false, r.why = "below its target";
    }
  }

  int reps_;
  std::string peer_path_;
  uint8_t* src_ = nullptr;
  uint8_t* dst_ = nullptr;
};

// The cuda_ipc peer: device memory of `bytes` with the bench's pattern,
// registered; "ready REGION HEX", then waits for "exit".
int peer_main(uint64_t bytes) {
  EngineOptions o;
  o.name = "gpu-bench-peer";
  o.transports = {"cuda_ipc"};
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  Result<void*> p = dev().allocate(0, bytes);
  if (!e.ok() || !p.ok()) {
    std::cout << "error " << (e.ok() ? p.error().to_string() : e.error().to_string()) << std::endl;
    return 1;
  }
  std::vector<uint8_t> host(bytes);
  conformance::fill_pattern(host.data(), bytes, 5, 0);
  if (!dev().copy_sync(*p, host.data(), bytes).ok()) return 1;
  Result<RegionId> r = (*e)->register_memory(*p, bytes, "cuda:0");
  if (!r.ok()) {
    std::cout << "error " << r.error().to_string() << std::endl;
    return 1;
  }
  std::cout << "ready " << *r << " " << to_hex((*e)->metadata()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line) && line != "exit") {
  }
  e->reset();
  (void)dev().free(*p);
  return 0;
}

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += static_cast<unsigned char>(ch) < 0x20 ? ' ' : ch;
  }
  return out + "\"";
}

std::string json_row(const Row& r) {
  std::ostringstream o;
  o << "{\"case\":" << quoted(r.case_name) << ",\"method\":" << quoted(r.method) << ",\"seconds\":" << r.seconds
    << ",\"gbps\":" << r.gbps << ",\"vs_contiguous\":" << r.vs_contiguous
    << ",\"vs_per_descriptor\":" << r.vs_per_descriptor << ",\"vs_batch\":" << r.vs_batch
    << ",\"wrong_bytes\":" << r.wrong << ",\"target\":" << quoted(r.target)
    << ",\"pass\":" << (r.pass ? "true" : "false") << ",\"why\":" << quoted(r.why) << "}";
  return o.str();
}

int bench_main(int reps, const std::string& json, const std::string& self, bool quick) {
  Result<int> n = dev().count();
  if (!n.ok()) {
    std::cout << "gpu-bench: FAIL (no device: " << n.error().to_string() << ")" << std::endl;
    return 1;
  }
  std::cout << "gpu-bench on the " << (Bench::real() ? "CUDA device 0" : "host fake (bytes judged, not figures)")
            << ", median of " << reps << " runs" << std::endl;
  std::vector<Case> cases = {{"10k_x_2KiB", 10000, 2048, false, false},
                             {"10k_x_16KiB", 10000, 16384, false, true},
                             {"1k_x_256KiB", 1000, 262144, false, false},
                             {"10k_x_16KiB_misaligned", 10000, 16384, true, false},
                             {"1_x_80MiB", 1, uint64_t{80} << 20, false, false}};
  if (quick) {
    for (Case& c : cases) c.count = std::max<uint64_t>(1, c.count / 10);
  }
  Bench bench(reps, self);
  std::vector<Row> rows;
  Status failed;
  for (const Case& c : cases) {
    if (Status s = bench.run_case(c, &rows); !s.ok()) failed = s.with_context(c.name);
  }
  if (Status s = bench.host_rows(&rows); !s.ok()) failed = s.with_context("pinned host rows");
  if (Status s = bench.producer_row(&rows); !s.ok()) failed = s.with_context("slow producer");
  // 256 MiB on a device; less on the fake, whose figures judge nothing.
  const uint64_t staged = Bench::real() ? 16384 : quick ? 256 : 2048;
  if (Status s = bench.staged_rows(staged, &rows); !s.ok()) failed = s.with_context("staged rows");
  std::printf("%-24s %-18s %10s %8s %8s %8s %8s %6s %s\n", "case", "method", "us", "GB/s", "xcontig", "xper", "xbatch",
              "wrong", "verdict");
  bool pass = failed.ok();
  for (const Row& r : rows) {
    std::string verdict = r.pass ? "PASS" : "FAIL";
    if (!r.target.empty()) verdict += " (target " + r.target + ")";
    if (!r.why.empty()) verdict += ": " + r.why;
    std::printf("%-24s %-18s %10.1f %8.2f %8.3f %8.2f %8.3f %6llu %s\n", r.case_name.c_str(), r.method.c_str(),
                r.seconds * 1e6, r.gbps, r.vs_contiguous, r.vs_per_descriptor, r.vs_batch,
                static_cast<unsigned long long>(r.wrong), verdict.c_str());
    pass = pass && r.pass;
  }
  // The crossover for device_copy "auto": the largest copy size (of the
  // aligned cases of many copies) at which the kernel beat the copy engines.
  uint64_t crossover = 0;
  for (const Case& c : cases) {
    if (c.misaligned || c.count < 2) continue;
    double kernel = 0, batch = 0;
    for (const Row& r : rows) {
      if (r.case_name != c.name) continue;
      if (r.method == "kernel") kernel = r.seconds;
      if (r.method == "batch") batch = r.seconds;
    }
    if (kernel > 0 && batch > 0 && kernel < batch) crossover = std::max(crossover, c.bytes);
  }
  std::printf("crossover: device_copy_kernel_below=%llu (the kernel beat the copy engines up to %llu-byte copies%s)\n",
              static_cast<unsigned long long>(crossover), static_cast<unsigned long long>(crossover),
              Bench::real() ? "" : "; on the fake this says nothing of a GPU");
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"device\":\"" << (Bench::real() ? "cuda" : "fake") << "\",\"crossover_bytes\":" << crossover
        << ",\"rows\":[";
    for (size_t i = 0; i < rows.size(); ++i) out << (i ? "," : "") << json_row(rows[i]);
    out << "],\"error\":" << quoted(failed.ok() ? "" : failed.to_string()) << "}\n";
  }
  if (!failed.ok()) std::cout << "error: " << failed.to_string() << std::endl;
  std::cout << "gpu-bench: " << (pass ? "PASS" : "FAIL") << " (" << rows.size() << " rows)" << std::endl;
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace kvbridge

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--peer") return kvbridge::peer_main(std::stoull(argv[2]));
  int reps = 5;
  std::string json;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else {
      std::cerr << "usage: gpu_bench [--reps N] [--json FILE] [--quick]\n";
      return 2;
    }
  }
  return kvbridge::bench_main(reps, json, argv[0], quick);
}

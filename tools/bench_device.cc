// `kvbridge bench --memory cuda`: cuda_ipc between device memory of this
// process and of a `kvbridge bench peer --transport cuda_ipc` child, once per
// copy method, each row against two baselines measured in the same run on
// the same device: one cudaMemcpy of the transfer's bytes in one contiguous
// piece (the bandwidth ceiling), and one cudaMemcpyAsync per descriptor on
// one stream (what connectors without a batched copy post). Both baselines
// copy between two buffers of this process, the same offsets as the row.
#include <chrono>
#include <thread>

#include "bench.h"
#include "bench_peer.h"
#include "device/device.h"

namespace kvbridge::cli::bench {
namespace {

constexpr std::chrono::milliseconds kTransferTimeout{15000};

// Device memory of device 0, freed with the object.
struct DeviceMemory {
  static Result<DeviceMemory> make(uint64_t bytes) {
    DeviceMemory m;
    KVB_ASSIGN_OR_RETURN(void* p, device::current().allocate(0, bytes));
    m.p = static_cast<uint8_t*>(p);
    m.bytes = bytes;
    // Touched, so the rows measure copies, not first-touch faults.
    std::vector<uint8_t> fill(bytes, 0x3c);
    KVB_RETURN_IF_ERROR(device::current().copy_sync(m.p, fill.data(), bytes));
    return m;
  }
  DeviceMemory() = default;
  DeviceMemory(DeviceMemory&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  ~DeviceMemory() {
    if (p != nullptr) (void)device::current().free(p);
  }
  uint8_t* p = nullptr;
  uint64_t bytes = 0;
};

bool await(device::Device& d, device::Event e) {
  for (;;) {
    Result<bool> done = d.done(e);
    if (!done.ok()) return false;
    if (*done) return true;
    std::this_thread::yield();
  }
}

}  // namespace

std::string device_description() {
  device::Device& d = device::current();
  Result<int> n = d.count();
  if (d.name() == "fake") return "on the host fake (KVB_DEVICE=fake: host memory, not a GPU's figures)";
  return "CUDA device 0 of " + (n.ok() ? std::to_string(*n) : std::string("?"));
}

Status bench_device(const BenchArgs& args, std::vector<BenchRow>& rows) {
  device::Device& d = device::current();
  KVB_ASSIGN_OR_RETURN(int devices, d.count());
  (void)devices;
  KVB_ASSIGN_OR_RETURN(DeviceMemory local, DeviceMemory::make(args.buffer_bytes));
  KVB_ASSIGN_OR_RETURN(DeviceMemory scratch, DeviceMemory::make(args.buffer_bytes));
  KVB_ASSIGN_OR_RETURN(device::Stream stream, d.create_stream(0));
  KVB_ASSIGN_OR_RETURN(device::Event event, d.create_event(0, false));
  KVB_ASSIGN_OR_RETURN(auto child, PeerProcess::spawn("cuda_ipc", args.buffer_bytes, args.threads, args.tcp_streams));

  Baseline contiguous;
  contiguous.name = "cudaMemcpy";
  contiguous.once = [&](const Workload& w, bool, uint64_t) {
    return d.copy_sync(scratch.p, local.p, w.bytes_per_transfer()).ok();
  };
  Baseline per_copy;
  per_copy.name = "cudaMemcpyAsync/descriptor";
  std::vector<device::DeviceCopy> copies;
  per_copy.once = [&](const Workload& w, bool read, uint64_t k) {
    copies.clear();
    for (const TransferItem& it : w.transfer(k)) {
      uint8_t* l = local.p + it.local_offset;
      uint8_t* r = scratch.p + it.remote_offset;
      copies.push_back(read ? device::DeviceCopy{l, r, it.bytes} : device::DeviceCopy{r, l, it.bytes});
    }
    return d.copy_each(stream, copies).ok() && d.record(event, stream).ok() && await(d, event);
  };

  Status outcome;
  for (const std::string& method : args.device_copies) {
    EngineOptions o;
    o.name = "bench";
    o.transports = {"cuda_ipc"};
    o.threads = args.threads;
    o.device_copy = method;
    Result<std::unique_ptr<Engine>> engine = Engine::create(o);
    if (!engine.ok()) {
      outcome = engine.error();
      break;
    }
    Result<RegionId> lr = (*engine)->register_memory(local.p, local.bytes, "cuda:0");
    Result<PeerId> peer = lr.ok() ? (*engine)->connect(child->metadata()) : Result<PeerId>(lr.error());
    if (!peer.ok()) {
      outcome = peer.error();
      break;
    }
    const std::string name = method == "copy_engine" ? "cuda_ipc" : "cuda_ipc/" + method;
    outcome = measure(name, args, **engine, *peer, *lr, child->region(), contiguous, rows, &per_copy);
    if (!outcome.ok()) break;
  }
  d.destroy_event(event);
  d.destroy_stream(stream);
  return outcome;
}

}  // namespace kvbridge::cli::bench

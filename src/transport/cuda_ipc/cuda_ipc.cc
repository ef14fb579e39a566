// The cuda_ipc transport: device memory of another process on this host,
// mapped into this one through CUDA IPC memory handles (device.h: the real
// cudaIpc* calls, or the host fake in CPU-only tests).
//
// Registration: add_segment() walks the allocations a cuda:N segment spans
// (pointer_info) and exports each one; the key blob carries, per
// allocation, its range and handle, plus a generation number of this
// transport's (never reused), so an importer can tell a segment registered
// again from the one it opened. Memory that cannot be exported (cuMemCreate,
// managed) still registers: its key says why, and a peer's run that needs it
// fails with that reason.
//
// Importing: a Link opens an allocation on the first run that touches it
// and keeps it open; the transport keeps one mapping per (handle, device)
// for the process (a handle opens once per device, on the device whose
// stream and kernels will use it), shared by every link and held by each
// run that uses it, so a refresh() that drops a segment (the peer
// deregistered it) closes the mapping only after the last run using it
// returned. A new registration has a new segment id and generation: a stale
// mapping is never used for it.
//
// A run's device is that of its local device memory; for a run into host
// memory, the exporter's device when this process sees it (its UUID in the
// key names it whatever either process's CUDA_VISIBLE_DEVICES), else this
// process's device 0. The kernel copies only runs whose local memory is all
// on that one device; the copy engines move the rest.
//
// A run translates its copies to (local pointer, mapped pointer) pairs and
// hands them to run_device_copies (device_run.h): one batched copy per
// transfer up to 64 MiB, after the producer's ready events, on a
// non-blocking stream of its own. The Link holds the peer's pidfd: a peer
// that exits ends the run (after the batches already queued land) and every
// later run, as kIoError naming it.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/host.h"
#include "common/thread_name.h"
#include "device/device.h"
#include "net/wire.h"
#include "transport/cuda_ipc/cuda_ipc_key.h"
#include "transport/device_run.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

// A peer allocation mapped into this process; closed when the last holder
// (the transport's table, links, runs) lets go.
struct Mapping {
  device::Device* device = nullptr;
  void* base = nullptr;
  ~Mapping() {
    if (base != nullptr) (void)device->close_memory(base);
  }
};

// Watches peers' pidfds on a thread of its own and calls a link's on_exit
// once its peer exits, so the link closes its mappings at once: a mapping
// of a dead process's allocation keeps that GPU memory allocated until the
// importer closes it. on_exit runs with the watcher's lock held, so
// unwatch() returning means it is not running and will not run.
class ExitWatcher {
 public:
  ~ExitWatcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake();
    if (thread_.joinable()) thread_.join();
    for (auto& [id, w] : watched_) ::close(w.first);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }
  // Watches a duplicate of `pidfd` (the caller keeps its own). 0 when the
  // watcher cannot start (the link then closes its mappings only with itself).
  uint64_t watch(int pidfd, std::function<void()> on_exit) {
    if (pidfd < 0) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    if (wake_fd_ < 0) {
      wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (wake_fd_ < 0) return 0;
      thread_ = std::thread([this] { loop(); });
    }
    const int fd = ::fcntl(pidfd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return 0;
    const uint64_t id = next_++;
    watched_[id] = {fd, std::move(on_exit)};
    wake();
    return id;
  }
  void unwatch(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = watched_.find(id);
    if (it == watched_.end()) return;
    ::close(it->second.first);
    watched_.erase(it);
    wake();
  }

 private:
  void wake() {
    if (wake_fd_ >= 0) {
      const uint64_t one = 1;
      (void)!::write(wake_fd_, &one, sizeof one);
    }
  }
  void loop() {
    set_thread_name("kvb-cipc-watch");
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<uint64_t> ids;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        fds.push_back({wake_fd_, POLLIN, 0});
        for (const auto& [id, w] : watched_) {
          fds.push_back({w.first, POLLIN, 0});
          ids.push_back(id);
        }
      }
      if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) return;
      if (fds[0].revents != 0) {
        uint64_t n = 0;
        (void)!::read(wake_fd_, &n, sizeof n);
      }
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto it = watched_.find(ids[i - 1]);
        // The descriptor polled is the watcher's own duplicate, closed only
        // under this lock: a fired one still in the table is that peer's.
        if (it == watched_.end()) continue;
        it->second.second();
        ::close(it->second.first);
        watched_.erase(it);
      }
    }
  }

  std::mutex mu_;
  std::map<uint64_t, std::pair<int, std::function<void()>>> watched_;
  uint64_t next_ = 1;
  int wake_fd_ = -1;
  bool stop_ = false;
  std::thread thread_;
};

// What every link of one transport shares; outlives the links.
struct Shared : DeviceSide {
  explicit Shared(device::Device& d) : DeviceSide(d) {}
  DeviceRunOptions options;

  // The mapping of `handle` on `on`, opened on first use; one per (handle,
  // device) for the process.
  Result<std::shared_ptr<Mapping>> open(const std::string& handle, int on) {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_pair(handle, on);
    auto it = mappings.find(key);
    if (it != mappings.end()) {
      if (auto m = it->second.lock()) return m;
      mappings.erase(it);
    }
    Result<void*> opened = device().open_memory(handle, on);
    // A mapping whose last holder just let go may still be closing on that
    // holder's thread: the handle opens again once it has.
    for (int i = 0; i < 200 && !opened.ok() && opened.error().code() == Code::kAlreadyExists; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      opened = device().open_memory(handle, on);
    }
    KVB_ASSIGN_OR_RETURN(void* base, std::move(opened));
    if (mappings.size() >= 1024) std::erase_if(mappings, [](const auto& e) { return e.second.expired(); });
    auto m = std::make_shared<Mapping>();
    m->device = &device();
    m->base = base;
    mappings[key] = m;
    return m;
  }

  // This process's ordinal of the device `uuid` names, -1 when it does not
  // see it; asked once per UUID.
  int ordinal(const std::string& uuid) {
    if (uuid.empty()) return -1;
    std::lock_guard<std::mutex> lock(mu);
    auto it = ordinals.find(uuid);
    if (it == ordinals.end()) {
      const Result<int> n = device::ordinal_of(device(), uuid);
      it = ordinals.emplace(uuid, n.ok() ? *n : -1).first;
    }
    return it->second;
  }

  std::mutex mu;
  std::map<std::pair<std::string, int>, std::weak_ptr<Mapping>> mappings;
  std::map<std::string, int> ordinals;
  ExitWatcher exits;
};

class CudaIpcLink final : public Link {
 public:
  // refresh(peer) must follow, before any run.
  CudaIpcLink(std::shared_ptr<Shared> shared, pid_t pid, int pidfd, const PeerInfo& peer)
      : shared_(std::move(shared)),
        pid_(pid),
        pidfd_(pidfd),
        who_("cuda_ipc peer '" + peer.name + "' (pid " + std::to_string(pid) + ")") {
    // When the peer exits, its mappings close at once (each run using one
    // keeps it until the run returns); later runs fail naming the peer.
    watch_ = shared_->exits.watch(pidfd_, [this] {
      std::lock_guard<std::mutex> lock(mu_);
      segments_.clear();
      gone_ = true;
      shared_->ready().forget(static_cast<uint64_t>(pid_));
    });
  }
  ~CudaIpcLink() override {
    shared_->exits.unwatch(watch_);
    if (pidfd_ >= 0) ::close(pidfd_);
  }

  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    KVB_RETURN_IF_ERROR(alive());
    std::vector<device::DeviceCopy> batch;
    std::vector<std::shared_ptr<Mapping>> holds;  // what this run reads or writes stays mapped
    int stream_device = -1;
    bool one_device = true;                           // every local pointer is device memory of stream_device
    const bool local_devices = shared_->has_local();  // else every local pointer is host memory
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.reserve(copies.size());
      // The run's device: its first local device memory's, else (host
      // memory only) the exporter's when this process sees it.
      for (const Copy& c : copies) {
        const int d = local_devices && c.bytes > 0 ? shared_->local_device(c.local) : -1;
        if (d >= 0) {
          stream_device = d;
          break;
        }
      }
      if (stream_device < 0) {
        for (const Copy& c : copies) {
          auto s = segments_.find(c.segment);
          if (c.bytes > 0 && s != segments_.end()) {
            stream_device = std::max(shared_->ordinal(s->second.key.uuid), 0);
            break;
          }
        }
      }
      for (const Copy& c : copies) {
        if (c.bytes == 0) continue;
        auto s = segments_.find(c.segment);
        if (s == segments_.end()) {
          return Status::out_of_range(who_ + ": segment " + std::to_string(c.segment) + " is not advertised");
        }
        Remote& seg = s->second;
        if (!seg.key.why_not.empty()) {
          return Status::unavailable(who_ + ": its segment " + std::to_string(c.segment) +
                                     " cannot be opened through CUDA IPC: " + seg.key.why_not);
        }
        if (c.remote < seg.base || c.bytes > seg.bytes || c.remote - seg.base > seg.bytes - c.bytes) {
          return Status::out_of_range(who_ + ": address " + std::to_string(c.remote) + " + " + std::to_string(c.bytes) +
                                      " is outside its segment " + std::to_string(c.segment));
        }
        const int local_device = local_devices ? shared_->local_device(c.local) : -1;
        if (local_device != stream_device) one_device = false;
        // The copy may cross from one allocation of the segment into the next.
        uint64_t at = c.remote, left = c.bytes;
        uint8_t* local = c.local;
        while (left > 0) {
          KVB_ASSIGN_OR_RETURN(auto piece, map_locked(seg, c.segment, at, stream_device, &holds));
          const uint64_t n = std::min(left, piece.second);
          if (op == TransferOp::kRead) {
            batch.push_back({local, piece.first, n});
          } else {
            batch.push_back({piece.first, local, n});
          }
          at += n;
          local += n;
          left -= n;
        }
      }
    }
    DeviceRunOptions options = shared_->options;
    // The kernel reads and writes device memory of its own device only.
    if (!one_device) options.method = device::CopyMethod::kCopyEngine;
    return run_device_copies(
        shared_->pool(), shared_->ready(), std::max(stream_device, 0), batch, options, control,
        [this] { return alive(); }, who_, static_cast<uint64_t>(pid_));
  }

  Status refresh(const PeerInfo& peer) override {
    std::map<uint32_t, Remote> fresh;
    for (const PeerSegment& s : peer.segments) {
      if (s.memory == "host" || s.key.empty()) continue;  // not served by cuda_ipc
      KVB_ASSIGN_OR_RETURN(CudaIpcKey key, decode_cuda_ipc_key(s.key));
      KVB_RETURN_IF_ERROR(
          check_cuda_ipc_key(key, s.base, s.bytes).with_context(who_ + " segment " + std::to_string(s.id)));
      fresh.emplace(s.id, Remote{s.base, s.bytes, std::move(key), {}});
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (gone_) return Status::io_error(who_ + " is gone: its process exited");
    // Mappings of a segment that stays with the same generation are kept;
    // the rest are dropped (closed once no run holds them).
    for (auto& [id, r] : fresh) {
      auto old = segments_.find(id);
      if (old != segments_.end() && old->second.key.generation == r.key.generation)
        r.mapped = std::move(old->second.mapped);
    }
    segments_ = std::move(fresh);
    return Status();
  }

 private:
  struct Remote {
    uint64_t base = 0, bytes = 0;
    CudaIpcKey key;
    // (allocation of key, device) -> its mapping there, opened on first use
    std::map<std::pair<size_t, int>, std::shared_ptr<Mapping>> mapped;
  };

  // Requires mu_. The local pointer, in its mapping on device `on`, of the
  // peer's address `at` in `seg`, and the bytes from there to the end of
  // its allocation.
  Result<std::pair<uint8_t*, uint64_t>> map_locked(Remote& seg, uint32_t id, uint64_t at, int on,
                                                   std::vector<std::shared_ptr<Mapping>>* holds) {
    for (size_t i = 0; i < seg.key.allocations.size(); ++i) {
      const CudaIpcAllocation& a = seg.key.allocations[i];
      if (at < a.base || at - a.base >= a.bytes) continue;
      std::shared_ptr<Mapping>& mapping = seg.mapped[{i, on}];
      if (!mapping) {
        Result<std::shared_ptr<Mapping>> m = shared_->open(a.handle, on);
        if (!m.ok()) {
          seg.mapped.erase({i, on});
          return Status(m.error().code(), who_ + ": opening segment " + std::to_string(id) + " allocation " +
                                              std::to_string(i) + " on cuda:" + std::to_string(on) + ": " +
                                              m.error().message());
        }
        mapping = std::move(*m);
      }
      if (holds->empty() || holds->back() != mapping) holds->push_back(mapping);
      return std::make_pair(static_cast<uint8_t*>(mapping->base) + (at - a.base), a.bytes - (at - a.base));
    }
    return Status::out_of_range(who_ + ": address " + std::to_string(at) + " of segment " + std::to_string(id) +
                                " is in none of its allocations");
  }

  Status alive() const {
    if (pidfd_ < 0) return Status();
    pollfd p{pidfd_, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return Status::io_error(who_ + " is gone: its process exited");
    return Status();
  }

  std::shared_ptr<Shared> shared_;
  const pid_t pid_;
  const int pidfd_;
  const std::string who_;
  uint64_t watch_ = 0;  // in shared_->exits
  std::mutex mu_;
  std::map<uint32_t, Remote> segments_;
  bool gone_ = false;  // the peer exited: its mappings are closed
};

class CudaIpcTransport final : public Transport {
 public:
  CudaIpcTransport(device::Device& device, DeviceRunOptions options) : shared_(std::make_shared<Shared>(device)) {
    shared_->options = options;
  }

  std::string_view name() const override { return "cuda_ipc"; }
  bool serves(std::string_view memory) const override { return memory.substr(0, 5) == "cuda:"; }
  bool moves(bool, bool remote_device) const override { return remote_device; }

  std::string address() const override {
    net::WireWriter w;
    w.str(boot_);
    w.str(shared_->device().name());
    return w.take();
  }

  Status can_reach(const PeerInfo& peer) const override {
    net::WireReader r(peer.address, "cuda_ipc address");
    std::string boot, kind;
    KVB_RETURN_IF_ERROR(r.str("boot_id", 64, &boot));
    KVB_RETURN_IF_ERROR(r.str("device", 16, &kind));
    KVB_RETURN_IF_ERROR(r.finish());
    if (peer.hostname != hostname_ || boot != boot_) {
      return Status::unavailable("peer '" + peer.name + "' is on host '" + peer.hostname +
                                 "', not this one: CUDA IPC reaches processes of one host");
    }
    if (kind != shared_->device().name()) {
      return Status::unavailable("peer '" + peer.name + "' uses the " + kind + " device, this process the " +
                                 std::string(shared_->device().name()));
    }
    if (peer.pid == static_cast<uint64_t>(::getpid())) {
      return Status::unavailable("peer '" + peer.name + "' is this process (the local transport moves its memory)");
    }
    if (::kill(static_cast<pid_t>(peer.pid), 0) != 0 && errno == ESRCH) {
      return Status::unavailable("peer '" + peer.name + "' (pid " + std::to_string(peer.pid) + ") does not exist");
    }
    return Status();
  }

  Result<std::string> add_segment(const Segment& segment) override {
    KVB_ASSIGN_OR_RETURN(int want, device::parse_cuda_memory(segment.memory));
    CudaIpcKey key;
    key.device = static_cast<uint32_t>(want);
    if (Result<std::string> uuid = shared_->device().uuid(want); uuid.ok()) key.uuid = *uuid;
    key.generation = next_generation_.fetch_add(1);
    const uint64_t begin = reinterpret_cast<uint64_t>(segment.base), end = begin + segment.bytes;
    for (uint64_t at = begin; at < end && key.why_not.empty();) {
      KVB_ASSIGN_OR_RETURN(device::PointerInfo info, shared_->device().pointer_info(reinterpret_cast<void*>(at)));
      if (info.type != device::MemoryType::kDevice || info.bytes == 0) {
        return Status::invalid_argument("cuda_ipc: segment " + std::to_string(segment.id) + " byte " +
                                        std::to_string(at - begin) + " is not device memory");
      }
      if (!info.exportable) {
        key.why_not = info.why_not;
        key.allocations.clear();
        break;
      }
      if (key.allocations.size() == kMaxCudaIpcAllocations) {
        key.why_not = "the segment spans more than " + std::to_string(kMaxCudaIpcAllocations) +
                      " allocations; register fewer, larger ones";
        key.allocations.clear();
        break;
      }
      KVB_ASSIGN_OR_RETURN(std::string handle, shared_->device().export_memory(reinterpret_cast<void*>(info.base)));
      key.allocations.push_back(CudaIpcAllocation{info.base, info.bytes, std::move(handle)});
      at = info.base + info.bytes;
    }
    shared_->add_local(segment.id, segment.base, segment.bytes, want);
    return encode_cuda_ipc_key(key);
  }

  Status remove_segment(uint32_t id) override {
    shared_->remove_local(id);
    return Status();
  }

  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_RETURN_IF_ERROR(can_reach(peer));
    const pid_t pid = static_cast<pid_t>(peer.pid);
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0 && errno == ESRCH) {
      return Status::unavailable("peer '" + peer.name + "' (pid " + std::to_string(pid) + ") does not exist");
    }
    auto link = std::make_unique<CudaIpcLink>(shared_, pid, pidfd, peer);
    KVB_RETURN_IF_ERROR(link->refresh(peer));  // a peer's malformed key fails the connect
    return std::unique_ptr<Link>(std::move(link));
  }

 private:
  std::shared_ptr<Shared> shared_;
  const std::string boot_ = boot_id();
  const std::string hostname_ = this_hostname();
  std::atomic<uint64_t> next_generation_{1};
};

}  // namespace

Result<std::unique_ptr<Transport>> make_cuda_ipc_transport(const DeviceCopyConfig& device_copy) {
  device::Device& device = device::current();
  KVB_ASSIGN_OR_RETURN(int n, device.count());
  (void)n;
  KVB_ASSIGN_OR_RETURN(DeviceRunOptions options, device_run_options(device_copy));
  return std::unique_ptr<Transport>(std::make_unique<CudaIpcTransport>(device, options));
}

}  // namespace kvbridge::transport

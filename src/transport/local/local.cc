// The local transport: a peer engine in this same process, reached by memcpy.
//
// It is the reference the conformance suite trusts, so it does the least
// that is correct: each copy is one memcpy, cut where needed so that cancel
// and the deadline are checked after every kSliceBytes of progress (across
// copies, not per copy: small copies would pay more for the checks than for
// the memcpy), so a cancel or a deadline is seen within one slice; bytes_done
// grows slice by slice and at the end. The engine has already checked every address against the
// peer's advertised segments; the link checks again that each copy lies in a
// segment the peer advertised (refresh() keeps that list), because a stale
// address in the same process would be silent corruption.
//
// Device memory (cuda:N segments, on either side): a run that touches any
// becomes one batched device copy (device_run.h: copy engines, after the
// caller's ready events, cancel and deadline kept by waiting for what was
// queued), so host<->device and device<->device copies in one process take
// the same path as cuda_ipc's.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "common/host.h"
#include "device/device.h"
#include "transport/copies.h"
#include "transport/device_run.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

constexpr uint64_t kSliceBytes = uint64_t{1} << 20;

class LocalLink final : public Link {
 public:
  LocalLink(const PeerInfo& peer, std::shared_ptr<DeviceSide> device, DeviceRunOptions options)
      : device_(std::move(device)), options_(options) {
    (void)refresh(peer);
  }

  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    std::vector<int> devices;  // the devices whose memory the run touches, the first first
    bool host = false;         // whether it touches host memory
    const bool local_device = device_ && device_->has_local();
    {
      std::shared_lock<std::shared_mutex> lock(mu_);
      for (const Copy& c : copies) {
        const Remote* s = remote_of_locked(c);
        if (s == nullptr) {
          return Status::out_of_range("local: copy to peer '" + peer_ + "' address " + std::to_string(c.remote) +
                                      " is outside its segment " + std::to_string(c.segment));
        }
        for (int d : {s->device, local_device ? device_->local_device(c.local) : -1}) {
          if (d < 0) {
            host = true;
          } else if (std::find(devices.begin(), devices.end(), d) == devices.end()) {
            devices.push_back(d);
          }
        }
      }
    }
    if (!devices.empty()) return run_on_device(op, copies, control, devices, host);
    if (control.ready_event != 0 || !control.ready_events.empty()) {
      return Status::invalid_argument("local: ready events apply to runs that touch device memory");
    }
    // Cancel and the deadline are checked, and bytes_done published, once
    // per kSliceBytes of progress across copies (and at the end), not per
    // copy: for small copies those checks cost as much as the memcpy.
    // The first check comes after the first slice: the engine checked both
    // just before starting the run.
    uint64_t budget = kSliceBytes;  // bytes that may be copied before the next check
    uint64_t pending = 0;           // bytes copied but not yet added to bytes_done
    for (const Copy& c : copies) {
      for (uint64_t done = 0; done < c.bytes;) {
        if (budget == 0) {
          if (pending > 0) control.bytes_done.fetch_add(pending, std::memory_order_release);
          pending = 0;
          if (control.cancel.load(std::memory_order_acquire)) {
            return Status::cancelled("local: run to peer '" + peer_ + "' cancelled");
          }
          if (Clock::now() >= control.deadline)
            return Status::timeout("local: run to peer '" + peer_ + "' passed its deadline");
          budget = kSliceBytes;
        }
        const uint64_t n = std::min(budget, c.bytes - done);
        uint8_t* remote = reinterpret_cast<uint8_t*>(c.remote) + done;
        if (op == TransferOp::kRead) {
          std::memcpy(c.local + done, remote, n);
        } else {
          std::memcpy(remote, c.local + done, n);
        }
        done += n;
        budget -= n;
        pending += n;
      }
    }
    if (pending > 0) control.bytes_done.fetch_add(pending, std::memory_order_release);
    return Status();
  }

  bool runs_inline() const override { return true; }

  // The peer is this process: its bytes are hashed where they are (device
  // memory by the device's kernel), after the same bounds check a run makes.
  Status digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes) override {
    (void)control;
    std::vector<device::DeviceRange> ranges;
    bool device = false;
    {
      std::shared_lock<std::shared_mutex> lock(mu_);
      for (const Copy& c : copies) {
        const Remote* s = remote_of_locked(c);
        if (s == nullptr) {
          return Status::out_of_range("local: digest of peer '" + peer_ + "' address " + std::to_string(c.remote) +
                                      " outside its segment " + std::to_string(c.segment));
        }
        device = device || s->device >= 0;
        ranges.push_back({reinterpret_cast<const void*>(c.remote), c.bytes});
      }
    }
    return content_hashes_in_place(ranges, device, hashes);
  }

  Status refresh(const PeerInfo& peer) override {
    std::unique_lock<std::shared_mutex> lock(mu_);
    peer_ = peer.name;
    segments_.clear();
    for (const PeerSegment& s : peer.segments) {
      const Result<int> device = device::parse_cuda_memory(s.memory);
      segments_[s.id] = Remote{s.base, s.bytes, device.ok() ? *device : -1};
    }
    return Status();
  }

 private:
  // On a stream of the first device the run touches. Between two devices
  // peer access is enabled first (the copy engines then copy directly, and
  // a kernel may reach the other device's memory); the kernel moves only
  // device memory of devices its own reaches, the copy engines the rest.
  Status run_on_device(TransferOp op, std::span<const Copy> copies, RunControl& control,
                       const std::vector<int>& devices, bool host) {
    DeviceRunOptions options = options_;
    if (host) options.method = device::CopyMethod::kCopyEngine;
    for (size_t i = 1; i < devices.size(); ++i) {
      if (!device_->peer_access(devices[0], devices[i])) options.method = device::CopyMethod::kCopyEngine;
    }
    std::vector<device::DeviceCopy> batch;
    batch.reserve(copies.size());
    for (const Copy& c : copies) {
      if (c.bytes == 0) continue;
      void* remote = reinterpret_cast<void*>(c.remote);
      if (op == TransferOp::kRead) {
        batch.push_back({c.local, remote, c.bytes});
      } else {
        batch.push_back({remote, c.local, c.bytes});
      }
    }
    return run_device_copies(device_->pool(), device_->ready(), devices[0], batch, options, control, nullptr,
                             "local: run to peer '" + peer_ + "'");
  }

  struct Remote {
    uint64_t base = 0, bytes = 0;
    int device = -1;  // cuda:N segments: N
  };
  // Requires mu_: the peer's segment that holds all of `c`'s remote side, or null.
  const Remote* remote_of_locked(const Copy& c) const {
    auto s = segments_.find(c.segment);
    if (s == segments_.end() || c.remote < s->second.base || c.bytes > s->second.bytes ||
        c.remote - s->second.base > s->second.bytes - c.bytes) {
      return nullptr;
    }
    return &s->second;
  }
  std::shared_ptr<DeviceSide> device_;  // null: no device in this process
  const DeviceRunOptions options_;
  std::shared_mutex mu_;
  std::string peer_;
  std::map<uint32_t, Remote> segments_;
};

class LocalTransport final : public Transport {
 public:
  explicit LocalTransport(DeviceRunOptions options) : options_(options) {}
  std::string_view name() const override { return "local"; }
  bool serves(std::string_view memory) const override { return memory == "host" || memory.substr(0, 5) == "cuda:"; }
  bool moves(bool, bool) const override { return true; }
  std::string address() const override { return std::to_string(pid_); }
  Status can_reach(const PeerInfo& peer) const override {
    if (peer.pid != pid_ || peer.hostname != hostname_) {
      return Status::unavailable("peer '" + peer.name + "' is process " + std::to_string(peer.pid) + " on host '" +
                                 peer.hostname + "', not this process " + std::to_string(pid_) + " on '" + hostname_ +
                                 "'");
    }
    return Status();
  }
  Result<std::string> add_segment(const Segment& segment) override {
    if (segment.memory == "host") return std::string();
    KVB_ASSIGN_OR_RETURN(int device, device::parse_cuda_memory(segment.memory));
    std::lock_guard<std::mutex> lock(mu_);
    if (!device_) device_ = std::make_shared<DeviceSide>(device::current());
    device_->add_local(segment.id, segment.base, segment.bytes, device);
    return std::string();
  }
  Status remove_segment(uint32_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (device_) device_->remove_local(id);
    return Status();
  }
  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_RETURN_IF_ERROR(can_reach(peer));
    std::lock_guard<std::mutex> lock(mu_);
    // A peer in this process shares this engine's device: the links need the
    // device side even before this engine registers device memory.
    if (!device_) device_ = std::make_shared<DeviceSide>(device::current());
    return std::unique_ptr<Link>(std::make_unique<LocalLink>(peer, device_, options_));
  }

 private:
  const DeviceRunOptions options_;
  std::mutex mu_;
  std::shared_ptr<DeviceSide> device_;
  const uint64_t pid_ = static_cast<uint64_t>(::getpid());
  const std::string hostname_ = this_hostname();
};

}  // namespace

Result<std::unique_ptr<Transport>> make_local_transport(const DeviceCopyConfig& device_copy) {
  KVB_ASSIGN_OR_RETURN(DeviceRunOptions options, device_run_options(device_copy));
  return std::unique_ptr<Transport>(std::make_unique<LocalTransport>(options));
}

}  // namespace kvbridge::transport

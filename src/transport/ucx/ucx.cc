// The ucx transport: any host through UCX 1.13 (Debian's libucx-dev), with
// whatever UCX selects: RDMA, tcp, shared memory (UCX_TLS chooses).
//
// address() is the UCP worker address (ucp_worker_get_address); add_segment
// maps the segment (ucp_mem_map) and returns its packed remote key
// (ucp_rkey_pack); connect() creates an endpoint from the peer's worker
// address with UCP_ERR_HANDLING_MODE_PEER and unpacks every peer key; run()
// is ucp_get_nbx / ucp_put_nbx per copy, then ucp_ep_flush_nbx for writes;
// the engine hands runs to the worker thread with start() (Link::runs_async).
// All UCP calls happen on one thread per transport (ucx_worker.h says why).
//
// Notifications travel on the engine's control connection (transport.h), so
// this transport uses no active messages yet; the context requests
// UCP_FEATURE_AM so that an AM notification path can be added without
// changing peers' wire-up.
//
// Trust: a peer's worker address and keys are parsed by UCX itself, which
// checks little; kvbridge bounds their size (4 KiB) and the engine checks
// every remote range against the peer's advertised segments before run().
#include "common/host.h"
#include "transport/transport.h"

#if defined(KVB_HAVE_UCX)

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "device/device.h"
#include "net/address.h"
#include "transport/staging.h"
#include "transport/ucx/ucx_worker.h"

namespace kvbridge::transport {
namespace {

constexpr size_t kMaxBlobBytes = 4096;

std::string who(const PeerInfo& peer) { return "ucx peer '" + peer.name + "'"; }

class UcxLink final : public Link {
 public:
  UcxLink(std::shared_ptr<ucx::Worker> worker, std::unique_ptr<ucx::Endpoint> endpoint)
      : worker_(std::move(worker)), endpoint_(std::move(endpoint)) {}

  ~UcxLink() override {
    worker_->call([this] { worker_->close(*endpoint_); });
  }

  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    return worker_->execute(*endpoint_, op, copies, control);
  }

  // The worker thread does the work anyway: hand it over directly, rather
  // than block an engine thread in run() (one thread wake-up less each way).
  bool runs_async() const override { return true; }
  void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done) override {
    worker_->start(*endpoint_, op, copies, control, std::move(done));
  }

  Status refresh(const PeerInfo& peer) override {
    std::map<uint32_t, std::string> keys;
    for (const PeerSegment& s : peer.segments) {
      if (s.memory != "host") continue;  // the peer's device memory: not reachable over ucx
      if (s.key.empty() || s.key.size() > kMaxBlobBytes)
        return Status::invalid_argument(who(peer) + ": segment " + std::to_string(s.id) + " has a key of " +
                                        std::to_string(s.key.size()) + " bytes (expected 1 to 4096)");
      keys[s.id] = s.key;
    }
    Status result;
    worker_->call([&] {
      ucx::Endpoint& e = *endpoint_;
      for (auto it = e.rkeys.begin(); it != e.rkeys.end();) {
        auto k = keys.find(it->first);
        if (k != keys.end() && k->second == e.keys[it->first]) {
          ++it;
          continue;
        }
        // Dropped or re-registered: a run may still hold requests that use
        // the key, so it waits for the end of the endpoint's active runs.
        if (e.active_runs > 0) e.retired.push_back(std::move(it->second));
        it = e.rkeys.erase(it);
      }
      e.keys = keys;
      if (e.ep == nullptr) return;  // unpacked when the endpoint reopens
      for (const auto& [id, key] : keys) {
        if (e.rkeys.count(id)) continue;
        auto rkey = std::make_unique<ucx::Rkey>();
        ucs_status_t s = ucp_ep_rkey_unpack(e.ep, key.data(), &rkey->handle);
        if (s != UCS_OK) {
          rkey->handle = nullptr;
          if (result.ok()) result = ucx::to_status(s, "ucp_ep_rkey_unpack of segment " + std::to_string(id), e.peer);
          continue;
        }
        e.rkeys[id] = std::move(rkey);
      }
    });
    return result;
  }

 private:
  std::shared_ptr<ucx::Worker> worker_;
  std::unique_ptr<ucx::Endpoint> endpoint_;
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(std::shared_ptr<ucx::Worker> worker) : worker_(std::move(worker)) {
    hostname_ = this_hostname();
  }

  // Local device memory, staged (staging.h): from here on links move it to
  // and from the peer's host memory. (The peer's device memory stays out of
  // reach: UCX serves remote memory itself, and Debian's has no CUDA.)
  void stage(std::shared_ptr<StagingPool> pool, std::shared_ptr<DeviceSide> side, DeviceRunOptions options) {
    pool_ = std::move(pool);
    side_ = std::move(side);
    device_options_ = options;
  }
  bool serves(std::string_view memory) const override {
    return memory == "host" || (pool_ && memory.substr(0, 5) == "cuda:");
  }
  bool moves(bool local_device, bool remote_device) const override {
    return !remote_device && (!local_device || pool_);
  }

  ~UcxTransport() override {
    worker_->call([this] {
      for (auto& [id, memh] : segments_) ucp_mem_unmap(worker_->context(), memh);
      segments_.clear();
    });
  }

  std::string_view name() const override { return "ucx"; }
  std::string address() const override { return worker_->address(); }

  Status can_reach(const PeerInfo& peer) const override {
    if (peer.address.empty() || peer.address.size() > kMaxBlobBytes)
      return Status::invalid_argument(who(peer) + ": worker address of " + std::to_string(peer.address.size()) +
                                      " bytes (expected 1 to 4096)");
    // Whether UCX has a route is known only once the endpoint wires up; a
    // failure then surfaces as the endpoint's error on the first run.
    return Status();
  }

  Result<std::string> add_segment(const Segment& segment) override {
    if (segment.memory != "host" && pool_) {
      // Staged: never mapped for UCX, no key for peers.
      KVB_ASSIGN_OR_RETURN(int device, device::parse_cuda_memory(segment.memory));
      side_->add_local(segment.id, segment.base, segment.bytes, device);
      return std::string();
    }
    if (segment.memory != "host")
      return Status::invalid_argument("ucx: segment " + std::to_string(segment.id) + " is '" + segment.memory +
                                      "' memory; without a device in this process ucx moves host memory only");
    if (segment.base == nullptr || segment.bytes == 0)
      return Status::invalid_argument("ucx: segment " + std::to_string(segment.id) + " is empty");
    Result<std::string> out = Status::internal("ucx: add_segment did not run");
    worker_->call([&] {
      auto old = segments_.find(segment.id);
      if (old != segments_.end()) {
        ucp_mem_unmap(worker_->context(), old->second);
        segments_.erase(old);
      }
      ucp_mem_map_params_t params{};
      params.field_mask =
          UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_PROT;
      params.address = segment.base;
      params.length = segment.bytes;
      // Only the remote access the engine grants (where the UCX transport
      // enforces registration rights, e.g. RDMA; the engine itself checks
      // every remote range against the peer's advertised access).
      params.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
                    ((segment.access & 1) ? UCP_MEM_MAP_PROT_REMOTE_READ : 0) |
                    ((segment.access & 2) ? UCP_MEM_MAP_PROT_REMOTE_WRITE : 0);
      ucp_mem_h memh = nullptr;
      ucs_status_t s = ucp_mem_map(worker_->context(), &params, &memh);
      if (s != UCS_OK) {
        out = ucx::to_status(s, "ucp_mem_map of segment " + std::to_string(segment.id), "");
        return;
      }
      void* packed = nullptr;
      size_t packed_bytes = 0;
      s = ucp_rkey_pack(worker_->context(), memh, &packed, &packed_bytes);
      if (s != UCS_OK) {
        ucp_mem_unmap(worker_->context(), memh);
        out = ucx::to_status(s, "ucp_rkey_pack of segment " + std::to_string(segment.id), "");
        return;
      }
      std::string key(static_cast<const char*>(packed), packed_bytes);
      ucp_rkey_buffer_release(packed);
      if (key.size() > kMaxBlobBytes) {
        ucp_mem_unmap(worker_->context(), memh);
        out = Status::resource_exhausted("ucx: the remote key of segment " + std::to_string(segment.id) + " is " +
                                         std::to_string(key.size()) + " bytes, over the 4096-byte bound");
        return;
      }
      segments_[segment.id] = memh;
      out = std::move(key);
    });
    return out;
  }

  Status remove_segment(uint32_t id) override {
    if (side_ && side_->has_local_segment(id)) {
      side_->remove_local(id);
      return Status();
    }
    Status result;
    worker_->call([&] {
      auto it = segments_.find(id);
      if (it == segments_.end()) {
        result = Status::not_found("ucx: no segment " + std::to_string(id));
        return;
      }
      result = ucx::to_status(ucp_mem_unmap(worker_->context(), it->second),
                              "ucp_mem_unmap of segment " + std::to_string(id), "");
      segments_.erase(it);
    });
    return result;
  }

  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_RETURN_IF_ERROR(can_reach(peer));
    auto endpoint = std::make_unique<ucx::Endpoint>();
    endpoint->worker = worker_.get();
    endpoint->peer = peer.name;
    endpoint->address = peer.address;
    for (const PeerSegment& s : peer.segments) {
      if (s.memory != "host") continue;  // the peer's device memory: not reachable over ucx
      if (s.key.empty() || s.key.size() > kMaxBlobBytes)
        return Status::invalid_argument(who(peer) + ": segment " + std::to_string(s.id) + " has a key of " +
                                        std::to_string(s.key.size()) + " bytes (expected 1 to 4096)");
      endpoint->keys[s.id] = s.key;
    }
    // The peer's process, watched when UCX cannot detect its death (see
    // Endpoint::peer_mode). Only on this host: a pid means nothing elsewhere.
    if (peer.pid != 0 && !peer.hostname.empty() && peer.hostname == hostname_)
      endpoint->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(peer.pid), 0));
    Status opened;
    worker_->call([&] { opened = worker_->open(*endpoint); });
    KVB_RETURN_IF_ERROR(opened);
    auto link = std::make_unique<UcxLink>(worker_, std::move(endpoint));
    if (!pool_) return std::unique_ptr<Link>(std::move(link));
    return make_staged_link(std::move(link), pool_, side_, device_options_, who(peer));
  }

 private:
  std::shared_ptr<ucx::Worker> worker_;
  std::map<uint32_t, ucp_mem_h> segments_;  // worker thread only
  std::string hostname_;
  std::shared_ptr<StagingPool> pool_;  // null: host memory only
  std::shared_ptr<DeviceSide> side_;
  DeviceRunOptions device_options_;
};

}  // namespace

// The devices UCX may use (UCX_NET_DEVICES) for an engine bound to `host`:
// its listeners (the tcp transport's, on every device it uses) then stay on
// the interface that holds the address, as the engine's own do. Empty (every
// device) for a wildcard host, "lo" for loopback, else that interface and
// every RDMA port (which listen on no IP address). A user's own
// UCX_NET_DEVICES wins.
Result<std::string> net_devices_for(const std::string& host_text) {
  if (std::getenv("UCX_NET_DEVICES") != nullptr) return std::string();
  KVB_ASSIGN_OR_RETURN(net::HostPort hp, net::parse_host(host_text.empty() ? "127.0.0.1" : host_text, "ucx host"));
  if (net::is_wildcard(hp.host)) return std::string();
  if (net::is_loopback(hp.host)) return std::string("lo");
  KVB_ASSIGN_OR_RETURN(std::string iface, net::interface_of(hp.host));
  std::string devices = iface;
  std::error_code ec;
  for (const auto& dev : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
    for (const auto& port : std::filesystem::directory_iterator(dev.path() / "ports", ec)) {
      devices += "," + dev.path().filename().string() + ":" + port.path().filename().string();
    }
  }
  return devices;
}

Result<std::unique_ptr<Transport>> make_ucx_transport(const std::string& host, const StagingOptions& staging,
                                                      const DeviceCopyConfig& device_copy) {
  KVB_RETURN_IF_ERROR(check_staging_options(staging).with_context("ucx"));
  KVB_ASSIGN_OR_RETURN(DeviceRunOptions device_options, device_run_options(device_copy));
  KVB_ASSIGN_OR_RETURN(std::string devices, net_devices_for(host));
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Worker> worker, ucx::Worker::create(devices));
  auto t = std::make_unique<UcxTransport>(std::move(worker));
  device::Device& device = device::current();
  if (Result<int> n = device.count(); n.ok() && *n > 0) {
    t->stage(std::make_shared<StagingPool>(device, staging), std::make_shared<DeviceSide>(device), device_options);
  }
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvbridge::transport

#else  // !KVB_HAVE_UCX

namespace kvbridge::transport {

Result<std::unique_ptr<Transport>> make_ucx_transport(const std::string&, const StagingOptions&,
                                                      const DeviceCopyConfig&) {
  return Status::unavailable("ucx: built without UCX: install libucx-dev and reconfigure");
}

}  // namespace kvbridge::transport

#endif

// The tcp transport: any host, several streams per peer, a small framed
// protocol (docs/formats/tcp-protocol.md). The serving half is TcpServer
// (tcp_server.cc), the client half TcpLink (tcp_link.cc); this file joins
// them behind transport.h. With a device in the process, device memory is
// staged through a pool of pinned host memory on both sides (staging.h):
// the server stages its device segments, and links stage local device
// memory (a StagedLink around the TcpLink).
#include <unistd.h>

#include <algorithm>

#include "common/host.h"
#include "device/device.h"
#include "transport/staging.h"
#include "transport/tcp/tcp_link.h"
#include "transport/tcp/tcp_server.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

constexpr uint32_t kMaxStreamsPerLink = 64;
constexpr std::chrono::milliseconds kConnectTimeout{10000};

std::string local_label() { return "pid " + std::to_string(::getpid()) + " on " + this_hostname(); }

class TcpTransport final : public Transport {
 public:
  TcpTransport(std::string host, uint32_t streams, std::string secret, std::unique_ptr<tcp::TcpServer> server)
      : host_(std::move(host)),
        streams_(streams),
        secret_(std::move(secret)),
        server_(std::move(server)),
        label_(local_label()) {}

  // Device memory, staged: from here on tcp serves and moves it. The
  // server stages through a pool of its own, so that runs waiting on a
  // peer never hold the slots this engine needs to serve that peer (two
  // engines writing to each other would otherwise wait on each other).
  void stage(device::Device& device, const StagingOptions& staging, DeviceRunOptions options) {
    pool_ = std::make_shared<StagingPool>(device, staging);
    side_ = std::make_shared<DeviceSide>(device);
    device_options_ = options;
    server_->set_staging(std::make_shared<StagingPool>(device, staging), side_, options);
  }

  std::string_view name() const override { return "tcp"; }
  bool serves(std::string_view memory) const override {
    return memory == "host" || (pool_ && memory.substr(0, 5) == "cuda:");
  }
  bool moves(bool local_device, bool remote_device) const override {
    return pool_ || (!local_device && !remote_device);
  }

  std::string address() const override {
    return tcp::format_address(net::HostPort{host_, server_->port()}, server_->instance());
  }

  Status can_reach(const PeerInfo& peer) const override {
    // Reachability over IP is only known by trying; connect() tries.
    return tcp::parse_address(peer.address, peer.name).status();
  }

  Result<std::string> add_segment(const Segment& segment) override {
    int device = -1;
    if (segment.memory != "host") {
      if (!pool_) {
        return Status::invalid_argument("tcp: segment " + std::to_string(segment.id) + " is '" + segment.memory +
                                        "' memory; without a device in this process tcp moves host memory only");
      }
      KVB_ASSIGN_OR_RETURN(device, device::parse_cuda_memory(segment.memory));
      side_->add_local(segment.id, segment.base, segment.bytes, device);
    }
    server_->add_segment(segment.id, reinterpret_cast<uint64_t>(segment.base), segment.bytes, segment.access, device);
    return std::string();
  }

  Status remove_segment(uint32_t id) override {
    server_->remove_segment(id);
    if (side_) side_->remove_local(id);
    return Status();
  }

  void set_local_identity(std::string_view name, uint64_t instance) override { label_ = engine_label(name, instance); }
  void grant(uint64_t grant, const std::string& label, std::shared_ptr<const GrantPlaces> places, bool read) override {
    server_->grant(grant, label, *places, read);
  }
  void share(uint64_t grant, const std::string& label, uint64_t like) override { server_->share(grant, label, like); }
  void revoke(uint64_t grant) override { server_->revoke(grant); }

  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_ASSIGN_OR_RETURN(tcp::TcpPeer target, tcp::parse_address(peer.address, peer.name));
    target.local_label = label_;
    target.secret = secret_;
    const std::string who = "tcp peer '" + target.name + "'";
    KVB_ASSIGN_OR_RETURN(std::unique_ptr<tcp::TcpLink> link,
                         tcp::TcpLink::create(std::move(target), streams_, kConnectTimeout));
    if (!pool_) return std::unique_ptr<Link>(std::move(link));
    return make_staged_link(std::move(link), pool_, side_, device_options_, who);
  }

 private:
  std::string host_;
  uint32_t streams_;
  std::string secret_;
  std::unique_ptr<tcp::TcpServer> server_;
  std::string label_;
  std::shared_ptr<StagingPool> pool_;  // null: host memory only
  std::shared_ptr<DeviceSide> side_;
  DeviceRunOptions device_options_;
};

}  // namespace

Result<std::unique_ptr<Transport>> make_tcp_transport(const std::string& host, uint32_t streams,
                                                      const std::string& secret, const std::string& advertise_host,
                                                      const StagingOptions& staging,
                                                      const DeviceCopyConfig& device_copy) {
  if (streams == 0 || streams > kMaxStreamsPerLink)
    return Status::invalid_argument("tcp: streams must be 1.." + std::to_string(kMaxStreamsPerLink) + ", not " +
                                    std::to_string(streams));
  KVB_ASSIGN_OR_RETURN(net::HostPort at, net::parse_host(host.empty() ? "127.0.0.1" : host, "tcp host"));
  KVB_RETURN_IF_ERROR(check_staging_options(staging).with_context("tcp"));
  KVB_ASSIGN_OR_RETURN(DeviceRunOptions device_options, device_run_options(device_copy));
  KVB_ASSIGN_OR_RETURN(std::unique_ptr<tcp::TcpServer> server, tcp::TcpServer::create(at, local_label(), secret));
  auto t = std::make_unique<TcpTransport>(advertise_host.empty() ? at.host : advertise_host, streams, secret,
                                          std::move(server));
  device::Device& device = device::current();
  if (Result<int> n = device.count(); n.ok() && *n > 0) {
    t->stage(device, staging, device_options);
  }
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvbridge::transport

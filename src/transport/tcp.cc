// The tcp transport: any host, several streams per peer, a small framed
// protocol (docs/formats/tcp-protocol.md). The serving half is TcpServer
// (tcp_server.cc), the client half TcpLink (tcp_link.cc); this file joins
// them behind transport.h.
#include <unistd.h>

#include <algorithm>

#include "transport/tcp_link.h"
#include "transport/tcp_server.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

constexpr uint32_t kMaxStreams = 64;
constexpr std::chrono::milliseconds kConnectTimeout{10000};

std::string local_label() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return "pid " + std::to_string(::getpid()) + " on " + host;
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(std::string host, uint32_t streams, std::unique_ptr<tcp::TcpServer> server)
      : host_(std::move(host)), streams_(streams), server_(std::move(server)), label_(local_label()) {}

  std::string_view name() const override { return "tcp"; }

  std::string address() const override {
    return tcp::format_address(tcp::HostPort{host_, server_->port()}, server_->instance());
  }

  Status can_reach(const PeerInfo& peer) const override {
    // Reachability over IP is only known by trying; connect() tries.
    return tcp::parse_address(peer.address, peer.name).status();
  }

  Result<std::string> add_segment(const Segment& segment) override {
    if (segment.memory != "host")
      return Status::invalid_argument("tcp: segment " + std::to_string(segment.id) + " is '" + segment.memory +
                                      "' memory; tcp moves host memory only");
    server_->add_segment(segment.id, reinterpret_cast<uint64_t>(segment.base), segment.bytes);
    return std::string();
  }

  Status remove_segment(uint32_t id) override {
    server_->remove_segment(id);
    return Status();
  }

  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_ASSIGN_OR_RETURN(tcp::TcpPeer target, tcp::parse_address(peer.address, peer.name));
    target.local_label = label_;
    KVB_ASSIGN_OR_RETURN(std::unique_ptr<tcp::TcpLink> link,
                         tcp::TcpLink::create(std::move(target), streams_, kConnectTimeout));
    return std::unique_ptr<Link>(std::move(link));
  }

 private:
  std::string host_;
  uint32_t streams_;
  std::unique_ptr<tcp::TcpServer> server_;
  std::string label_;
};

}  // namespace

Result<std::unique_ptr<Transport>> make_tcp_transport(const std::string& host, uint32_t streams) {
  if (streams == 0 || streams > kMaxStreams)
    return Status::invalid_argument("tcp: streams must be 1.." + std::to_string(kMaxStreams) + ", not " +
                                    std::to_string(streams));
  // "host" or "host:port"; a bare host listens on an ephemeral port.
  std::string bind_host = host.empty() ? "127.0.0.1" : host;
  uint16_t port = 0;
  bool bare_v6 = bind_host.front() != '[' && std::count(bind_host.begin(), bind_host.end(), ':') > 1;
  if (Result<tcp::HostPort> hp = tcp::parse_host_port(bind_host); hp.ok() && !bare_v6) {
    bind_host = hp->host;
    port = hp->port;
  } else if (bind_host.size() > 2 && bind_host.front() == '[' && bind_host.back() == ']') {
    bind_host = bind_host.substr(1, bind_host.size() - 2);
  }
  KVB_ASSIGN_OR_RETURN(std::unique_ptr<tcp::TcpServer> server,
                       tcp::TcpServer::create(bind_host, port, local_label()));
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(bind_host, streams, std::move(server)));
}

}  // namespace kvbridge::transport

// A misbehaving side channel (see fake_side_channel.h).
#include "testing/fake_side_channel.h"

#include <poll.h>
#include <sys/socket.h>

#include <random>

#include "net/frame.h"
#include "net/opening.h"
#include "net/socket.h"

namespace kvbridge::testing {

using connector::kHandshakeVersion;

Result<std::unique_ptr<FakeSideChannel>> FakeSideChannel::start(Options options) {
  std::unique_ptr<FakeSideChannel> f(new FakeSideChannel(std::move(options)));
  KVB_ASSIGN_OR_RETURN(net::HostPort at, net::parse_host(f->options_.host, "fake side channel host"));
  KVB_ASSIGN_OR_RETURN(net::Listening l, net::listen_on(at, 64, "fake side channel"));
  f->listen_fd_ = std::move(l.fd);
  f->address_ = net::format_host_port(l.bound);
  f->thread_ = std::thread([raw = f.get()] { raw->loop(); });
  return f;
}

FakeSideChannel::~FakeSideChannel() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void FakeSideChannel::loop() {
  while (!stop_.load()) {
    pollfd p{listen_fd_.get(), POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    net::Fd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (fd) serve(fd.get());
  }
}

void FakeSideChannel::serve(int fd) {
  const net::IoLimits limits{net::Clock::now() + options_.timeout, &stop_, nullptr};
  const net::OpeningConfig config{net::Protocol::kSideChannel, kHandshakeVersion, options_.secret,
                                  net::OpeningLimits{connector::kOpenBodyBytes, connector::kMaxRefuseDetailBytes}};
  if (options_.mode == Mode::kGarbage) {
    std::string junk(64, '\0');
    std::minstd_rand random(std::random_device{}());
    for (char& c : junk) c = static_cast<char>(random());
    (void)net::send_bytes(fd, junk.data(), junk.size(), limits, "fake");
  } else if (options_.mode == Mode::kOtherVersion) {
    // A server of the next version refuses every older client.
    net::Session none;
    std::string out;
    net::append_frame(
        out, {net::Protocol::kSideChannel, net::kRefuse, static_cast<uint16_t>(kHandshakeVersion + 1), 0, false},
        net::encode_refusal({net::RefuseCode::kVersion, "version mismatch", ""}, 0), none);
    (void)net::send_bytes(fd, out.data(), out.size(), limits, "fake");
  } else {
    // The real opening exchange, then half of the real Metadata frame.
    net::ServerOpening opening(config);
    net::FrameReader reader(net::Protocol::kSideChannel, kHandshakeVersion, connector::max_payload_bytes);
    std::string buf;
    while (true) {
      reader.next();
      while (!reader.ready()) {
        buf.resize(reader.wanted());
        if (!net::recv_bytes(fd, buf.data(), buf.size(), limits, "fake").ok() || !reader.feed(buf).ok()) return;
      }
      net::ServerOpening::Step step = opening.on_frame(reader.header(), reader.raw_header(), reader.payload());
      if (step.kind == net::ServerOpening::Step::Kind::kRefuse) return;
      if (step.kind == net::ServerOpening::Step::Kind::kSend) {
        if (!net::send_bytes(fd, step.bytes.data(), step.bytes.size(), limits, "fake").ok()) return;
        continue;
      }
      break;
    }
    connector::SideChannelOptions sc;
    sc.secret = options_.secret;
    sc.timeout = options_.timeout;
    Result<connector::RankInfo> info =
        connector::fetch_rank_info(options_.real_address, options_.identity, options_.hash, sc);
    if (!info.ok()) return;
    Result<std::string> payload = connector::encode_metadata({options_.hash, *info});
    if (!payload.ok()) return;
    net::Session session = opening.take_session();
    std::string out;
    net::append_frame(out, {net::Protocol::kSideChannel, connector::kMetadataFrame, kHandshakeVersion, 0, false},
                      *payload, session);
    (void)net::send_bytes(fd, out.data(), out.size() / 2, limits, "fake");
  }
  ::shutdown(fd, SHUT_WR);
  char sink[256];
  while (net::recv_bytes(fd, sink, 1, limits, "fake").ok()) {
  }
}

}  // namespace kvbridge::testing

// The serving half of the tcp transport (see tcp_server.h and
// docs/formats/tcp-protocol.md).
#include "transport/tcp_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>

#include "common/checked.h"
#include "transport/tcp_socket.h"

namespace kvbridge::transport::tcp {
namespace {

// A peer that starts a frame must finish it within this time; an idle stream
// between frames may stay open for as long as both sides live.
constexpr std::chrono::seconds kFrameTimeout{30};
constexpr std::chrono::seconds kHelloTimeout{10};

uint64_t random_instance() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

// Server waits poll no flag: the destructor's shutdown() of every stream
// wakes them, so they need not wake up every few milliseconds to look.
IoLimits frame_limits() { return IoLimits{Clock::now() + kFrameTimeout, nullptr, nullptr}; }

}  // namespace

Result<std::unique_ptr<TcpServer>> TcpServer::create(const std::string& host, uint16_t port, std::string label) {
  uint16_t bound = 0;
  KVB_ASSIGN_OR_RETURN(int fd, listen_on(host, port, &bound));
  std::unique_ptr<TcpServer> server(new TcpServer(fd, bound, std::move(label)));
  if (::pipe2(server->wake_fds_, O_CLOEXEC) != 0)
    return Status::io_error("tcp: pipe: " + errno_text(errno));
  server->accept_thread_ = std::thread([s = server.get()] { s->accept_loop(); });
  return server;
}

TcpServer::TcpServer(int listen_fd, uint16_t port, std::string label)
    : listen_fd_(listen_fd), port_(port), instance_(random_instance()), label_(std::move(label)) {}

TcpServer::~TcpServer() {
  stop_.store(true);
  if (wake_fds_[1] >= 0) {
    char c = 0;
    [[maybe_unused]] ssize_t n = ::write(wake_fds_[1], &c, 1);
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    // Wakes every serving thread: its next poll sees the shutdown.
    std::lock_guard lock(conns_mutex_);
    for (auto& c : conns_) {
      if (c->fd >= 0) ::shutdown(c->fd, SHUT_RDWR);
    }
  }
  for (auto& c : conns_) {
    if (c->thread.joinable()) c->thread.join();
  }
  ::close(listen_fd_);
  if (wake_fds_[0] >= 0) ::close(wake_fds_[0]);
  if (wake_fds_[1] >= 0) ::close(wake_fds_[1]);
}

void TcpServer::add_segment(uint32_t id, uint64_t base, uint64_t bytes) {
  std::unique_lock lock(segments_mutex_);
  segments_[id] = SegmentSpan{base, bytes};
}

void TcpServer::remove_segment(uint32_t id) {
  std::unique_lock lock(segments_mutex_);
  segments_.erase(id);
  epoch_.fetch_add(1);
}

std::optional<SegmentSpan> TcpServer::lookup_locked(uint32_t id) const {
  auto it = segments_.find(id);
  if (it == segments_.end()) return std::nullopt;
  return it->second;
}

void TcpServer::reap_finished() {
  std::list<std::unique_ptr<Conn>> done;
  {
    std::lock_guard lock(conns_mutex_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if ((*it)->finished.load()) {
        done.push_back(std::move(*it));
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) c->thread.join();
}

void TcpServer::accept_loop() {
  while (!stop_.load()) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
    int n = ::poll(p, 2, 1000);
    if (n < 0 && errno != EINTR) break;
    reap_finished();
    if (n <= 0 || !(p[0].revents & POLLIN)) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    tune_socket(fd);
    std::lock_guard lock(conns_mutex_);
    if (stop_.load()) {
      ::close(fd);
      break;
    }
    auto conn = std::make_unique<Conn>();
    conn->fd = fd;
    Conn* raw = conn.get();
    conns_.push_back(std::move(conn));
    raw->thread = std::thread([this, raw, fd] { serve(raw, fd); });
  }
}

void TcpServer::close_conn(Conn* conn) {
  std::lock_guard lock(conns_mutex_);
  ::close(conn->fd);
  conn->fd = -1;
}

void TcpServer::serve(Conn* conn, int fd) {
  std::string peer = "an unidentified peer";
  Status s = serve_frames(fd, peer);
  (void)s;  // the stream ends; the client sees the close and reports it
  close_conn(conn);
  conn->finished.store(true);
}

Status TcpServer::serve_frames(int fd, std::string& peer) {
  // The hello: the client names the instance it wants (from our address
  // blob), so a stale address that now belongs to another engine is refused.
  uint8_t head[kHeaderBytes];
  IoLimits hello_limits{Clock::now() + kHelloTimeout, nullptr, nullptr};
  KVB_RETURN_IF_ERROR(recv_bytes(fd, head, sizeof head, hello_limits, "tcp hello"));
  Result<FrameHeader> h = decode_header(head);
  if (!h.ok() || h->type != FrameType::kHello) {
    std::string out;
    encode_error(h.ok() ? Status::invalid_argument("tcp: expected a hello frame") : h.error(), out);
    (void)send_bytes(fd, out.data(), out.size(), hello_limits, "tcp hello");
    return Status::invalid_argument("tcp: bad hello");
  }
  std::vector<uint8_t> body(h->payload_bytes);
  KVB_RETURN_IF_ERROR(recv_bytes(fd, body.data(), body.size(), hello_limits, "tcp hello"));
  Result<Hello> hello = decode_hello(body);
  Status refuse;
  if (!hello.ok()) {
    refuse = hello.error();
  } else if (hello->version_min > kVersion || hello->version_max < kVersion) {
    refuse = Status::incompatible("tcp: protocol versions " + std::to_string(hello->version_min) + ".." +
                                  std::to_string(hello->version_max) + " requested, this server speaks " +
                                  std::to_string(kVersion));
  } else if (hello->instance != instance_) {
    refuse = Status::unavailable("tcp: this address belongs to another engine instance now (stale metadata?)");
  }
  std::string out;
  if (!refuse.ok()) {
    encode_error(refuse, out);
    (void)send_bytes(fd, out.data(), out.size(), hello_limits, "tcp hello");
    return refuse;
  }
  peer = "'" + hello->label + "'";
  encode_hello(FrameType::kHelloOk, Hello{kVersion, kVersion, instance_, label_}, out);
  KVB_RETURN_IF_ERROR(send_bytes(fd, out.data(), out.size(), hello_limits, "tcp hello"));

  for (;;) {
    // Idle between frames: wait without a deadline and without polling a
    // flag; the destructor's shutdown() wakes this wait.
    IoLimits idle{Clock::time_point::max(), nullptr, nullptr};
    KVB_RETURN_IF_ERROR(recv_bytes(fd, head, 1, idle, "tcp request"));
    KVB_RETURN_IF_ERROR(recv_bytes(fd, head + 1, sizeof head - 1, frame_limits(), "tcp request"));
    Result<FrameHeader> header = decode_header(head);
    if (!header.ok() || (header->type != FrameType::kRead && header->type != FrameType::kWrite)) {
      // A stream that sent garbage cannot be resynchronised: answer and close.
      out.clear();
      encode_error(header.ok() ? Status::invalid_argument("tcp: unexpected frame from a client") : header.error(),
                   out);
      (void)send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp request");
      return Status::invalid_argument("tcp: bad frame");
    }
    KVB_RETURN_IF_ERROR(serve_request(fd, *header, peer));
  }
}

Status TcpServer::serve_request(int fd, const FrameHeader& header, const std::string& peer) {
  std::vector<uint8_t> table(header.payload_bytes);
  KVB_RETURN_IF_ERROR(recv_bytes(fd, table.data(), table.size(), frame_limits(), "tcp request"));
  std::vector<Range> ranges;
  uint64_t total = 0;
  Status valid;
  {
    std::shared_lock lock(segments_mutex_);
    valid = decode_ranges(table, header.count, [this](uint32_t id) { return lookup_locked(id); }, &ranges, &total);
  }
  bool is_write = header.type == FrameType::kWrite;
  std::string out;
  if (!valid.ok()) {
    if (is_write) {
      // Keep the stream in step: the bulk data that follows is read and
      // dropped, when its announced size is sane; else the stream closes.
      uint64_t announced = 0;
      bool sane = true;
      for (uint32_t i = 0; i < header.count && sane; ++i) {
        uint64_t len = 0;
        for (int b = 7; b >= 0; --b) len = (len << 8) | table[size_t{i} * kRangeBytes + 16 + b];
        sane = checked_add(announced, len, &announced) && announced <= kMaxFrameDataBytes;
      }
      if (!sane) {
        encode_error(valid, out);
        (void)send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp request");
        return valid;
      }
      KVB_RETURN_IF_ERROR(drain(fd, announced, peer));
    }
    encode_error(valid, out);
    return send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
  }
  if (is_write) {
    KVB_RETURN_IF_ERROR(move_data(fd, false, ranges, {}, peer));
    encode_header({FrameType::kWriteAck, header.count, 0}, out);
    return send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
  }
  encode_header({FrameType::kReadData, header.count, 0}, out);
  return move_data(fd, true, ranges, out, peer);
}

Status TcpServer::move_data(int fd, bool to_socket, const std::vector<Range>& ranges, const std::string& prefix,
                            const std::string& peer) {
  IovCursor cursor;
  if (!prefix.empty()) cursor.push(const_cast<char*>(prefix.data()), prefix.size());
  for (const Range& r : ranges) cursor.push(reinterpret_cast<void*>(r.address), r.bytes);
  uint64_t validated_epoch = epoch_.load();
  IoLimits limits = frame_limits();
  std::string who = "tcp serving " + peer;
  while (!cursor.done()) {
    size_t moved = 0;
    {
      std::shared_lock lock(segments_mutex_);
      if (epoch_.load() != validated_epoch) {
        // A segment was removed: the frame's ranges must still be registered.
        for (const Range& r : ranges) {
          std::optional<SegmentSpan> seg = lookup_locked(r.segment);
          if (!seg || r.address < seg->base || r.address + r.bytes > seg->base + seg->bytes)
            return Status::unavailable(who + ": segment " + std::to_string(r.segment) +
                                       " was removed during a transfer");
        }
        validated_epoch = epoch_.load();
      }
      KVB_ASSIGN_OR_RETURN(moved, to_socket ? send_step(fd, cursor, who) : recv_step(fd, cursor, who));
    }
    if (moved == 0) KVB_RETURN_IF_ERROR(wait_fd(fd, to_socket ? POLLOUT : POLLIN, limits, who));
  }
  return Status();
}

Status TcpServer::drain(int fd, uint64_t bytes, const std::string& peer) {
  std::vector<uint8_t> scratch(std::min<uint64_t>(bytes, 1 << 16));
  IoLimits limits = frame_limits();
  while (bytes > 0) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, scratch.size()));
    KVB_RETURN_IF_ERROR(recv_bytes(fd, scratch.data(), n, limits, "tcp serving " + peer));
    bytes -= n;
  }
  return Status();
}

}  // namespace kvbridge::transport::tcp

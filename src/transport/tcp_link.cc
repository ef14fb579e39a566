// The client half of the tcp transport (see tcp_link.h and
// docs/formats/tcp-protocol.md).
#include "transport/tcp_link.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <thread>

#include "transport/tcp_protocol.h"

namespace kvbridge::transport::tcp {
namespace {

// Frames carry at most this many ranges and bytes: large enough that the
// per-frame cost vanishes (a batch of 10,000 2 KiB copies is ten frames),
// small enough that a stream has several frames in flight.
constexpr size_t kFrameRanges = 1024;
constexpr uint64_t kFrameBytes = uint64_t{16} << 20;
// Frames a stream sends ahead of the replies it has received.
constexpr size_t kFramesAhead = 4;
// A run smaller than this per stream uses fewer streams.
constexpr uint64_t kBytesPerStream = uint64_t{1} << 20;

// One request frame of a stream's share: pieces [first, first + count).
struct Frame {
  size_t first = 0;
  size_t count = 0;
  uint32_t ranges = 0;
  uint64_t bytes = 0;
  std::string head;  // header + range table
};

std::vector<Frame> build_frames(TransferOp op, std::span<const Copy> pieces) {
  std::vector<Frame> frames;
  std::vector<Range> ranges;
  auto flush = [&](size_t end) {
    if (ranges.empty()) return;
    Frame& f = frames.back();
    f.count = end - f.first;
    f.ranges = static_cast<uint32_t>(ranges.size());
    encode_ranges_header(op == TransferOp::kRead ? FrameType::kRead : FrameType::kWrite, ranges, f.head);
    ranges.clear();
  };
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Copy& c = pieces[i];
    bool contiguous = !ranges.empty() && ranges.back().segment == c.segment &&
                      ranges.back().address + ranges.back().bytes == c.remote;
    if (frames.empty() || frames.back().bytes + c.bytes > kFrameBytes ||
        (!contiguous && ranges.size() == kFrameRanges)) {
      flush(i);
      frames.push_back(Frame{i, 0, 0, 0, {}});
      contiguous = false;
    }
    if (contiguous) {
      ranges.back().bytes += c.bytes;
    } else {
      ranges.push_back(Range{c.segment, c.remote, c.bytes});
    }
    frames.back().bytes += c.bytes;
  }
  flush(pieces.size());
  return frames;
}

// Splits `copies` into `parts` shares of about equal bytes, cutting copies at
// share boundaries and into pieces of at most kFrameBytes.
std::vector<std::vector<Copy>> split(std::span<const Copy> copies, size_t parts, uint64_t total) {
  std::vector<std::vector<Copy>> shares(parts);
  uint64_t per_share = (total + parts - 1) / parts;
  size_t share = 0;
  uint64_t in_share = 0;
  for (const Copy& c : copies) {
    uint64_t done = 0;
    while (done < c.bytes) {
      if (in_share == per_share && share + 1 < parts) {
        ++share;
        in_share = 0;
      }
      uint64_t n = std::min({c.bytes - done, per_share - in_share, kFrameBytes});
      if (share + 1 == parts) n = std::min(c.bytes - done, kFrameBytes);
      shares[share].push_back(Copy{c.local + done, c.remote + done, n, c.segment});
      done += n;
      in_share += n;
    }
  }
  return shares;
}

}  // namespace

std::string format_address(const HostPort& hp, uint64_t instance) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, instance);
  return format_host_port(hp) + "/" + buf;
}

Result<TcpPeer> parse_address(std::string_view blob, std::string peer_name) {
  size_t slash = blob.rfind('/');
  if (slash == std::string_view::npos || blob.size() - slash - 1 != 16)
    return Status::invalid_argument("tcp: peer '" + peer_name + "' address '" + std::string(blob.substr(0, 200)) +
                                    "' is not host:port/instance");
  TcpPeer peer;
  peer.name = std::move(peer_name);
  KVB_ASSIGN_OR_RETURN(peer.address, parse_host_port(blob.substr(0, slash)));
  std::string hex(blob.substr(slash + 1));
  if (!std::all_of(hex.begin(), hex.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))
    return Status::invalid_argument("tcp: peer '" + peer.name + "' address has a bad instance id");
  peer.instance = std::stoull(hex, nullptr, 16);
  return peer;
}

TcpLink::TcpLink(TcpPeer peer, uint32_t streams) : peer_(std::move(peer)) {
  who_ = "tcp peer '" + peer_.name + "' (" + format_host_port(peer_.address) + ")";
  for (uint32_t i = 0; i < std::max<uint32_t>(streams, 1); ++i) {
    all_.push_back(std::make_unique<Stream>());
    idle_.push_back(all_.back().get());
  }
}

TcpLink::~TcpLink() {
  for (auto& s : all_) close(*s);
}

Result<std::unique_ptr<TcpLink>> TcpLink::create(TcpPeer peer, uint32_t streams,
                                                 std::chrono::milliseconds connect_timeout) {
  std::unique_ptr<TcpLink> link(new TcpLink(std::move(peer), streams));
  KVB_RETURN_IF_ERROR(link->open(*link->all_[0], IoLimits{Clock::now() + connect_timeout, nullptr, nullptr}));
  return link;
}

Status TcpLink::refresh(const PeerInfo&) { return Status(); }

void TcpLink::close(Stream& stream) {
  if (stream.fd >= 0) ::close(stream.fd);
  stream.fd = -1;
}

Status TcpLink::open(Stream& stream, const IoLimits& limits) {
  close(stream);
  KVB_ASSIGN_OR_RETURN(int fd, dial(peer_.address, limits, who_));
  stream.fd = fd;
  std::string out;
  encode_hello(FrameType::kHello, Hello{kVersion, kVersion, peer_.instance, peer_.local_label}, out);
  Status s = send_bytes(fd, out.data(), out.size(), limits, who_);
  uint8_t head[kHeaderBytes];
  if (s.ok()) s = recv_bytes(fd, head, sizeof head, limits, who_ + ": hello");
  Result<FrameHeader> h = s.ok() ? decode_header(head) : Result<FrameHeader>(s);
  if (h.ok()) {
    std::vector<uint8_t> body(h->payload_bytes);
    s = recv_bytes(fd, body.data(), body.size(), limits, who_ + ": hello");
    if (s.ok() && h->type == FrameType::kError) {
      s = decode_error(body).with_context(who_ + " refused the connection");
    } else if (s.ok() && h->type != FrameType::kHelloOk) {
      s = Status::io_error(who_ + ": unexpected reply to hello");
    } else if (s.ok()) {
      Result<Hello> hello = decode_hello(body);
      if (!hello.ok()) {
        s = hello.error().with_context(who_);
      } else if (hello->version_min != kVersion || hello->instance != peer_.instance) {
        s = Status::incompatible(who_ + ": hello answered with version " + std::to_string(hello->version_min) +
                                 " by another instance");
      }
    }
  } else {
    s = h.error().code() == Code::kInvalidArgument ? Status::io_error(who_ + ": " + h.error().message()) : h.error();
  }
  if (!s.ok()) close(stream);
  return s;
}

Result<std::vector<TcpLink::Stream*>> TcpLink::acquire(size_t wanted, const IoLimits& limits) {
  std::unique_lock lock(mutex_);
  while (idle_.empty()) {
    Status s = check_limits(limits, who_ + ": waiting for a free stream");
    if (!s.ok()) return s;
    idle_cv_.wait_for(lock, kCancelSlice);
  }
  size_t n = std::min(wanted, idle_.size());
  std::vector<Stream*> taken(idle_.end() - static_cast<ptrdiff_t>(n), idle_.end());
  idle_.resize(idle_.size() - n);
  return taken;
}

void TcpLink::release(const std::vector<Stream*>& streams) {
  {
    std::lock_guard lock(mutex_);
    // Healthy streams go to the back, where acquire() takes from first.
    for (Stream* s : streams) {
      if (s->fd < 0) idle_.insert(idle_.begin(), s);
      else idle_.push_back(s);
    }
  }
  idle_cv_.notify_all();
}

Status TcpLink::run(TransferOp op, std::span<const Copy> copies, RunControl& control) {
  uint64_t total = 0;
  for (const Copy& c : copies) total += c.bytes;
  if (total == 0) return Status();
  IoLimits limits{control.deadline, &control.cancel, nullptr};
  size_t wanted = static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>(all_.size(), total / kBytesPerStream)));
  KVB_ASSIGN_OR_RETURN(std::vector<Stream*> streams, acquire(wanted, limits));
  std::vector<std::vector<Copy>> shares = split(copies, streams.size(), total);

  std::atomic<bool> abort{false};
  std::vector<Status> results(streams.size());
  std::vector<std::thread> helpers;
  for (size_t i = 1; i < streams.size(); ++i) {
    helpers.emplace_back([&, i] {
      results[i] = run_stream(*streams[i], op, shares[i], control, abort);
      if (!results[i].ok()) abort.store(true);
    });
  }
  results[0] = run_stream(*streams[0], op, shares[0], control, abort);
  if (!results[0].ok()) abort.store(true);
  for (auto& t : helpers) t.join();
  release(streams);

  // A real error wins over the "aborted" of the streams it stopped.
  Status first;
  for (Status& s : results) {
    if (!s.ok() && (first.ok() || (first.code() == Code::kCancelled && s.code() != Code::kCancelled))) first = s;
  }
  if (first.code() == Code::kTimeout || first.code() == Code::kCancelled) {
    first = Status(first.code(), first.message() + " (" + std::to_string(control.bytes_done.load()) + " of " +
                                     std::to_string(total) + " bytes done)");
  }
  return first;
}

Status TcpLink::run_stream(Stream& stream, TransferOp op, std::span<const Copy> pieces, RunControl& control,
                           const std::atomic<bool>& abort) {
  if (pieces.empty()) return Status();
  IoLimits limits{control.deadline, &control.cancel, &abort};
  bool reading = op == TransferOp::kRead;
  const char* verb = reading ? "read" : "write";
  if (stream.fd < 0) {
    Status s = open(stream, limits);
    if (!s.ok()) return s;
  }
  std::vector<Frame> frames = build_frames(op, pieces);
  auto local_iovecs = [&](const Frame& f, IovCursor& cursor) {
    for (size_t i = f.first; i < f.first + f.count; ++i) cursor.push(pieces[i].local, pieces[i].bytes);
  };

  size_t next_send = 0, next_recv = 0;
  bool sending = false;
  IovCursor send_cursor;
  enum class RecvState { kHead, kData, kErrorBody } recv_state = RecvState::kHead;
  uint8_t head[kHeaderBytes];
  std::vector<uint8_t> error_body;
  IovCursor recv_cursor;
  recv_cursor.push(head, sizeof head);
  Status failure;

  while (next_recv < frames.size()) {
    failure = check_limits(limits, who_ + ": " + verb);
    if (!failure.ok()) break;
    bool progressed = false;
    if (!sending && next_send < frames.size() && next_send - next_recv < kFramesAhead) {
      send_cursor = IovCursor();
      Frame& f = frames[next_send];
      send_cursor.push(f.head.data(), f.head.size());
      if (!reading) local_iovecs(f, send_cursor);
      sending = true;
    }
    if (sending) {
      Result<size_t> n = send_step(stream.fd, send_cursor, who_);
      if (!n.ok()) {
        failure = n.error();
        break;
      }
      progressed |= *n > 0;
      if (send_cursor.done()) {
        sending = false;
        ++next_send;
      }
    }
    if (next_recv < next_send) {
      Result<size_t> n = recv_step(stream.fd, recv_cursor, who_);
      if (!n.ok()) {
        failure = n.error();
        break;
      }
      progressed |= *n > 0;
      if (recv_state == RecvState::kData && *n > 0) control.bytes_done.fetch_add(*n, std::memory_order_relaxed);
      if (recv_cursor.done()) {
        const Frame& f = frames[next_recv];
        if (recv_state == RecvState::kHead) {
          Result<FrameHeader> h = decode_header(head);
          if (!h.ok()) {
            failure = Status::io_error(who_ + ": bad reply: " + h.error().message());
            break;
          }
          if (h->type == FrameType::kError) {
            error_body.assign(h->payload_bytes, 0);
            recv_cursor = IovCursor();
            recv_cursor.push(error_body.data(), error_body.size());
            recv_state = RecvState::kErrorBody;
          } else if (h->count != f.ranges ||
                     h->type != (reading ? FrameType::kReadData : FrameType::kWriteAck)) {
            failure = Status::io_error(who_ + ": reply does not match the " + verb + " request");
            break;
          } else if (reading) {
            recv_cursor = IovCursor();
            local_iovecs(f, recv_cursor);
            recv_state = RecvState::kData;
          } else {
            control.bytes_done.fetch_add(f.bytes, std::memory_order_relaxed);
            ++next_recv;
            recv_cursor = IovCursor();
            recv_cursor.push(head, sizeof head);
          }
        } else if (recv_state == RecvState::kErrorBody) {
          failure = decode_error(error_body).with_context(who_ + " refused a " + verb);
          break;
        } else {
          ++next_recv;
          recv_state = RecvState::kHead;
          recv_cursor = IovCursor();
          recv_cursor.push(head, sizeof head);
        }
      }
    }
    if (!progressed) {
      short events = static_cast<short>((sending ? POLLOUT : 0) | (next_recv < next_send ? POLLIN : 0));
      failure = wait_fd(stream.fd, events, limits, who_ + ": " + verb);
      if (!failure.ok()) break;
    }
  }
  // Any ending but a clean one leaves the stream mid-frame: close it, so no
  // further byte of this run lands locally, and the next run dials afresh.
  if (!failure.ok()) close(stream);
  return failure;
}

}  // namespace kvbridge::transport::tcp

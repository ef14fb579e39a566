// The client half of the tcp transport (see tcp_link.h and
// docs/formats/tcp-protocol.md).
#include "transport/tcp/tcp_link.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <thread>

#include "common/text.h"
#include "common/thread_name.h"
#include "net/frame.h"
#include "net/opening.h"
#include "transport/copies.h"
#include "transport/tcp/tcp_protocol.h"

namespace kvbridge::transport::tcp {
namespace {

// Frames carry at most this many ranges and bytes: large enough that the
// per-frame cost vanishes and a frame's data is 1 MiB or more for pieces of
// 64 bytes and up (a range costs 24 bytes of the frame's table), small
// enough that a stream has several frames in flight.
constexpr size_t kFrameRanges = 16384;
constexpr uint64_t kFrameBytes = uint64_t{16} << 20;
// Frames a stream sends ahead of the replies it has received.
constexpr size_t kFramesAhead = 4;
// How long a stopped write waits for the acknowledgements of the frames it
// sent (run_stream): as long as ucx waits for its puts (kStopGrace).
constexpr std::chrono::milliseconds kDrainGrace{200};
// A run smaller than this per stream uses fewer streams.
constexpr uint64_t kBytesPerStream = uint64_t{1} << 20;

// One request frame of a stream's share: pieces [first, first + count).
struct Frame {
  size_t first = 0;
  size_t count = 0;
  uint32_t ranges = 0;
  uint64_t bytes = 0;
  std::string head;  // the whole frame (header, range table, tag); bulk data follows for writes
};

// Groups pieces into frames of at most kFrameRanges ranges and kFrameBytes,
// merging pieces contiguous on the peer; each frame is encoded (and tagged)
// with `session`, in the order the stream sends them.
std::vector<Frame> build_frames(TransferOp op, std::span<const Copy> pieces, net::Session& session) {
  std::vector<Frame> frames;
  std::vector<Range> ranges;
  auto flush = [&](size_t end) {
    if (ranges.empty()) return;
    Frame& f = frames.back();
    f.count = end - f.first;
    f.ranges = static_cast<uint32_t>(ranges.size());
    net::append_frame(f.head, {net::Protocol::kTcp, op == TransferOp::kRead ? kRead : kWrite, kVersion, 0, false},
                      encode_ranges(ranges), session);
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

std::atomic<uint64_t> g_wire_frames{0}, g_wire_bytes{0}, g_wire_small{0};

}  // namespace

std::string format_address(const net::HostPort& hp, uint64_t instance) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, instance);
  return net::format_host_port(hp) + "/" + buf;
}

Result<TcpPeer> parse_address(std::string_view blob, std::string peer_name) {
  const size_t slash = blob.rfind('/');
  if (slash == std::string_view::npos || blob.size() - slash - 1 != 16)
    return Status::invalid_argument("tcp: peer '" + peer_name + "' address '" + printable(blob) +
                                    "' is not host:port/instance");
  TcpPeer peer;
  peer.name = std::move(peer_name);
  KVB_ASSIGN_OR_RETURN(peer.address, net::parse_host_port(blob.substr(0, slash), "tcp address"));
  const std::string_view hex = blob.substr(slash + 1);
  const auto [end, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), peer.instance, 16);
  if (ec != std::errc() || end != hex.data() + hex.size())
    return Status::invalid_argument("tcp: peer '" + peer.name + "' address has a bad instance id");
  return peer;
}

TcpLink::TcpLink(TcpPeer peer, uint32_t streams)
    : peer_(std::move(peer)), runners_(std::make_unique<RunThreads>(std::max<uint32_t>(streams, 1), "kvb-tcp-run")) {
  who_ = "tcp peer '" + peer_.name + "' (" + net::format_host_port(peer_.address) + ")";
  for (uint32_t i = 0; i < std::max<uint32_t>(streams, 1); ++i) {
    all_.push_back(std::make_unique<Stream>());
    idle_.push_back(all_.back().get());
  }
}

TcpLink::~TcpLink() {
  runners_.reset();  // queued runs end first
  for (auto& s : all_) close(*s);
}

void TcpLink::start(TransferOp op, std::span<const Copy> copies, RunControl& control,
                    std::function<void(Status)> done) {
  auto shared_done = std::make_shared<std::function<void(Status)>>(std::move(done));
  Status posted =
      runners_->post([this, op, copies, &control, shared_done] { (*shared_done)(run(op, copies, control)); });
  if (!posted.ok()) (*shared_done)(posted.with_context(who_));
}

Result<std::unique_ptr<TcpLink>> TcpLink::create(TcpPeer peer, uint32_t streams,
                                                 std::chrono::milliseconds connect_timeout) {
  std::unique_ptr<TcpLink> link(new TcpLink(std::move(peer), streams));
  KVB_RETURN_IF_ERROR(link->open(*link->all_[0], net::IoLimits{Clock::now() + connect_timeout, nullptr, nullptr}));
  return link;
}

Status TcpLink::refresh(const PeerInfo&) { return Status(); }

void TcpLink::close(Stream& stream) {
  stream.fd.reset();
  stream.session = net::Session();
}

Status TcpLink::open(Stream& stream, const net::IoLimits& limits) {
  close(stream);
  const net::OpeningConfig config{net::Protocol::kTcp, kVersion, peer_.secret,
                                  net::OpeningLimits{8 + 4 + kMaxLabelBytes, 0}};
  Result<net::Dialed> dialed =
      net::dial_and_open(peer_.address, config, encode_open_body(peer_.instance, peer_.local_label), payload_limit,
                         limits, who_, nullptr, true);
  if (!dialed.ok()) return dialed.error();
  if (dialed->opened.header.type != kAccept) {
    return Status::io_error(who_ + ": the peer answered the opening with frame type " +
                            std::to_string(dialed->opened.header.type));
  }
  stream.fd = std::move(dialed->fd);
  stream.session = std::move(dialed->opened.session);
  return Status();
}

Result<std::vector<TcpLink::Stream*>> TcpLink::acquire(size_t wanted, const net::IoLimits& limits) {
  std::unique_lock lock(mutex_);
  while (idle_.empty()) {
    Status s = net::check_limits(limits, who_ + ": waiting for a free stream");
    if (!s.ok()) return s;
    idle_cv_.wait_for(lock, net::kCancelSlice);
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
      if (!s->fd)
        idle_.insert(idle_.begin(), s);
      else
        idle_.push_back(s);
    }
  }
  idle_cv_.notify_all();
}

Status TcpLink::run(TransferOp op, std::span<const Copy> copies, RunControl& control) {
  uint64_t total = 0;
  for (const Copy& c : copies) total += c.bytes;
  if (total == 0) return Status();
  net::IoLimits limits{control.deadline, &control.cancel, nullptr};
  size_t wanted = static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>(all_.size(), total / kBytesPerStream)));
  KVB_ASSIGN_OR_RETURN(std::vector<Stream*> streams, acquire(wanted, limits));
  // A share per stream, in pieces of at most a frame's bytes.
  const std::vector<std::vector<Copy>> shares = split_by_bytes(copies, streams.size(), kFrameBytes);
  Status first = run_shares(shares, [&](size_t i, std::span<const Copy> share, const std::atomic<bool>& abort) {
    return run_stream(*streams[i], op, share, control, abort);
  });
  release(streams);
  if (first.code() == Code::kTimeout || first.code() == Code::kCancelled) {
    first = Status(first.code(), first.message() + " (" + std::to_string(control.bytes_done.load()) + " of " +
                                     std::to_string(total) + " bytes done)");
  }
  return first;
}

Status TcpLink::run_stream(Stream& stream, TransferOp op, std::span<const Copy> pieces, RunControl& control,
                           const std::atomic<bool>& abort) {
  if (pieces.empty()) return Status();
  const net::IoLimits limits{control.deadline, &control.cancel, &abort};
  // A pooled stream has nothing to read between runs: readable or hung up
  // means the peer closed it (its server reclaimed an idle stream).
  if (stream.fd) {
    pollfd p{stream.fd.get(), POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) != 0) close(stream);
  }
  const bool pooled = static_cast<bool>(stream.fd);
  if (!pooled) KVB_RETURN_IF_ERROR(open(stream, limits));
  bool answered = false;
  Status s = run_frames(stream, op, pieces, control, abort, &answered);
  // Closed in order before any reply: the server reclaimed the pooled
  // stream and served nothing of this run. (A server that failed resets the
  // stream, or its process is gone and the new dial is refused.)
  if (!net::closed_by_peer(s) || !pooled || answered || control.cancel.load() || abort.load()) return s;
  KVB_RETURN_IF_ERROR(open(stream, limits));
  return run_frames(stream, op, pieces, control, abort, &answered);
}

Status TcpLink::run_frames(Stream& stream, TransferOp op, std::span<const Copy> pieces, RunControl& control,
                           const std::atomic<bool>& abort, bool* answered) {
  net::IoLimits limits{control.deadline, &control.cancel, &abort};
  const bool reading = op == TransferOp::kRead;
  const char* verb = reading ? "read" : "write";
  // A write stopped by cancel (or a sibling stream's failure) drains: the
  // frame being sent is finished and every frame sent is acknowledged
  // before this returns, so nothing of the run lands at the peer after it
  // (the server writes a frame's bytes as they arrive). Within
  // kDrainGrace; a peer that does not answer by then gets the stream
  // closed, and the error says that sent frames may still land.
  Status stopped;
  const int fd = stream.fd.get();
  std::vector<Frame> frames = build_frames(op, pieces, stream.session);
  auto local_iovecs = [&](const Frame& f, net::IovCursor& cursor) {
    for (size_t i = f.first; i < f.first + f.count; ++i) cursor.push(pieces[i].local, pieces[i].bytes);
  };

  size_t next_send = 0, next_recv = 0;
  bool sending = false;
  net::IovCursor send_cursor;
  // A reply: its header, then its payload and tag, then (ReadData) the bytes.
  enum class RecvState { kHead, kBody, kData } recv_state = RecvState::kHead;
  char head[net::kFrameHeaderBytes];
  std::string body;
  net::FrameHeader reply;
  net::IovCursor recv_cursor;
  recv_cursor.push(head, sizeof head);
  Status failure;

  // A write's cancel, seen between steps or while waiting: drain from now on.
  auto drain_instead = [&](Status& seen) {
    if (seen.code() != Code::kCancelled || reading || !stopped.ok()) return false;
    stopped = std::move(seen);
    seen = Status();
    limits = net::IoLimits{std::min(control.deadline, Clock::now() + kDrainGrace), nullptr, nullptr};
    return true;
  };
  while (next_recv < (stopped.ok() ? frames.size() : next_send + (sending ? 1 : 0))) {
    failure = net::check_limits(limits, who_ + ": " + verb);
    if (drain_instead(failure)) continue;
    if (!failure.ok()) break;
    bool progressed = false;
    if (!sending && stopped.ok() && next_send < frames.size() && next_send - next_recv < kFramesAhead) {
      send_cursor = net::IovCursor();
      Frame& f = frames[next_send];
      send_cursor.push(f.head.data(), f.head.size());
      if (!reading) local_iovecs(f, send_cursor);
      sending = true;
    }
    if (sending) {
      Result<size_t> n = net::send_step(fd, send_cursor, who_);
      if (!n.ok()) {
        failure = n.error();
        break;
      }
      progressed |= *n > 0;
      if (send_cursor.done()) {
        const uint64_t bytes = frames[next_send].bytes;
        g_wire_frames.fetch_add(1, std::memory_order_relaxed);
        g_wire_bytes.fetch_add(bytes, std::memory_order_relaxed);
        if (bytes < (uint64_t{1} << 20)) g_wire_small.fetch_add(1, std::memory_order_relaxed);
        sending = false;
        ++next_send;
      }
    }
    if (next_recv < next_send) {
      Result<size_t> n = net::recv_step(fd, recv_cursor, who_);
      if (!n.ok()) {
        failure = n.error();
        break;
      }
      progressed |= *n > 0;
      *answered |= *n > 0;
      if (recv_state == RecvState::kData && *n > 0) control.bytes_done.fetch_add(*n, std::memory_order_relaxed);
      if (recv_cursor.done()) {
        const Frame& f = frames[next_recv];
        if (recv_state == RecvState::kHead) {
          Result<net::FrameHeader> h =
              net::decode_header(std::string_view(head, sizeof head), net::Protocol::kTcp, kVersion, payload_limit);
          if (!h.ok() || h->tagged != stream.session.keyed()) {
            failure = Status::io_error(
                who_ + ": bad reply: " + (h.ok() ? "tag flag does not match the session" : h.error().message()));
            break;
          }
          reply = *h;
          body.assign(reply.payload_bytes + (reply.tagged ? net::kTagBytes : 0), '\0');
          recv_cursor = net::IovCursor();
          recv_cursor.push(body.data(), body.size());
          recv_state = RecvState::kBody;
        } else if (recv_state == RecvState::kBody) {
          const std::string_view payload = std::string_view(body).substr(0, reply.payload_bytes);
          if (reply.tagged && !stream.session.check(std::string_view(head, sizeof head), payload,
                                                    std::string_view(body).substr(reply.payload_bytes))) {
            failure = Status::permission_denied(who_ + ": authentication failed: a reply has a wrong tag");
            break;
          }
          if (reply.type == kError) {
            failure = decode_error(payload).with_context(who_ + " refused a " + verb);
            break;
          }
          Result<uint32_t> count = decode_count(payload);
          if (!count.ok() || *count != f.ranges || reply.type != (reading ? kReadData : kWriteAck)) {
            failure = Status::io_error(who_ + ": reply does not match the " + verb + " request");
            break;
          }
          recv_cursor = net::IovCursor();
          if (reading) {
            local_iovecs(f, recv_cursor);
            recv_state = RecvState::kData;
          } else {
            control.bytes_done.fetch_add(f.bytes, std::memory_order_relaxed);
            ++next_recv;
            recv_cursor.push(head, sizeof head);
            recv_state = RecvState::kHead;
          }
        } else {
          ++next_recv;
          recv_state = RecvState::kHead;
          recv_cursor = net::IovCursor();
          recv_cursor.push(head, sizeof head);
        }
      }
    }
    if (!progressed) {
      short events = static_cast<short>((sending ? POLLOUT : 0) | (next_recv < next_send ? POLLIN : 0));
      failure = net::wait_fd(fd, events, limits, who_ + ": " + verb);
      if (drain_instead(failure)) continue;
      if (!failure.ok()) break;
    }
  }
  if (!stopped.ok()) {
    if (failure.ok()) return stopped;  // drained: the stream is between frames, and stays open
    failure = Status(stopped.code(), stopped.message() + "; the peer did not acknowledge the " +
                                         std::to_string(next_send + (sending ? 1 : 0) - next_recv) +
                                         " frame(s) already sent (" + failure.message() + "), which may still land");
  }
  // Any ending but a clean one leaves the stream mid-frame: close it, so no
  // further byte of this run lands locally, and the next run dials afresh.
  if (!failure.ok()) close(stream);
  return failure;
}

Status TcpLink::digest_frame(Stream& stream, std::span<const Copy> copies, const net::IoLimits& limits,
                             std::vector<uint64_t>* hashes, bool* answered) {
  std::vector<Range> ranges;
  ranges.reserve(copies.size());
  for (const Copy& c : copies) ranges.push_back(Range{c.segment, c.remote, c.bytes});
  std::string out;
  net::append_frame(out, {net::Protocol::kTcp, kDigest, kVersion, 0, false}, encode_ranges(ranges), stream.session);
  KVB_RETURN_IF_ERROR(net::send_bytes(stream.fd.get(), out.data(), out.size(), limits, who_ + ": digest"));
  net::FrameReader reader(net::Protocol::kTcp, kVersion, payload_limit);
  KVB_RETURN_IF_ERROR(net::read_frame(stream.fd.get(), reader, stream.session, limits, who_ + ": digest"));
  *answered = true;
  if (reader.header().type == kError) return decode_error(reader.payload()).with_context(who_ + " refused a digest");
  if (reader.header().type != kDigestData) {
    return Status::io_error(who_ + ": a digest was answered with frame type " + std::to_string(reader.header().type));
  }
  return decode_hashes(reader.payload(), static_cast<uint32_t>(copies.size()), hashes).with_context(who_);
}

Status TcpLink::digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes) {
  hashes->clear();
  hashes->reserve(copies.size());
  if (copies.empty()) return Status();
  const net::IoLimits limits{control.deadline, &control.cancel, nullptr};
  KVB_ASSIGN_OR_RETURN(std::vector<Stream*> streams, acquire(1, limits));
  Stream& stream = *streams[0];
  // Frames of at most kDigestRanges ranges and kMaxFrameDataBytes bytes.
  constexpr size_t kDigestRanges = 4096;
  Status s;
  std::vector<uint64_t> part;
  for (size_t first = 0; s.ok() && first < copies.size();) {
    size_t n = 0;
    uint64_t bytes = 0;
    while (first + n < copies.size() && n < kDigestRanges && bytes + copies[first + n].bytes <= kMaxFrameDataBytes) {
      bytes += copies[first + n].bytes;
      ++n;
    }
    if (n == 0) n = 1;  // one copy past the frame's bytes: the server refuses it by name
    if (stream.fd) {
      pollfd p{stream.fd.get(), POLLIN | POLLRDHUP, 0};
      if (::poll(&p, 1, 0) != 0) close(stream);
    }
    const bool pooled = static_cast<bool>(stream.fd);
    if (!pooled) s = open(stream, limits);
    bool answered = false;
    if (s.ok()) s = digest_frame(stream, copies.subspan(first, n), limits, &part, &answered);
    // A pooled stream the server reclaimed, closed before any answer: once more on a fresh one.
    if (net::closed_by_peer(s) && pooled && !answered && !control.cancel.load()) {
      close(stream);
      s = open(stream, limits);
      if (s.ok()) s = digest_frame(stream, copies.subspan(first, n), limits, &part, &answered);
    }
    if (s.ok()) hashes->insert(hashes->end(), part.begin(), part.end());
    first += n;
  }
  // A stream that failed mid-frame is closed, so nothing of it is read later.
  if (!s.ok() && stream.fd) close(stream);
  release(streams);
  return s;
}

}  // namespace kvbridge::transport::tcp

namespace kvbridge::transport {
WireCounts tcp_wire_counts() {
  return WireCounts{tcp::g_wire_frames.load(), tcp::g_wire_bytes.load(), tcp::g_wire_small.load()};
}
}  // namespace kvbridge::transport

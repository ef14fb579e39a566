// The serving half of the tcp transport (see tcp_server.h and
// docs/formats/tcp-protocol.md).
#include "transport/tcp/tcp_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>

#include "common/checked.h"
#include "common/random.h"
#include "common/text.h"
#include "common/thread_name.h"
#include "net/opening.h"
#include "net/socket.h"
#include "net/wire.h"
#include "transport/copies.h"

namespace kvbridge::transport::tcp {
namespace {

using net::Clock;

// A peer that starts a frame must finish it within this time; an idle stream
// between frames may stay open for as long as both sides live, or until the
// listener gives its place to a new client.
constexpr std::chrono::seconds kFrameTimeout{30};
// How often an idle stream looks whether its place was reclaimed, and how
// long a reclaimed one waits for its client to close.
constexpr std::chrono::seconds kReclaimCheck{1};
constexpr std::chrono::seconds kReclaimLinger{2};

// Closes a reclaimed stream in order: this end first, then what the client
// still sends (a request sent before it saw the close) is read and dropped
// until it closes too, so it sees an orderly close and not a reset.
void close_reclaimed(int fd) {
  ::shutdown(fd, SHUT_WR);
  char sink[4096];
  const net::IoLimits limits{Clock::now() + kReclaimLinger};
  while (net::wait_fd(fd, POLLIN, limits, "reclaimed tcp stream").ok()) {
    const ssize_t n = ::recv(fd, sink, sizeof sink, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return;
  }
}

// Server waits poll no flag: the destructor's shutdown() of every stream
// wakes them, so they need not wake up every few milliseconds to look.
net::IoLimits frame_limits() { return net::IoLimits{Clock::now() + kFrameTimeout, nullptr, nullptr}; }

}  // namespace

Result<std::unique_ptr<TcpServer>> TcpServer::create(const net::HostPort& at, std::string label, std::string secret) {
  std::unique_ptr<TcpServer> server(new TcpServer(std::move(label)));
  server->instance_ = random_nonzero_u64();
  net::ListenerOptions l;
  l.name = "tcp listener";
  l.thread_name = "kvb-tcp-listen";
  l.bind = at;
  l.opening = net::OpeningConfig{net::Protocol::kTcp, kVersion, std::move(secret),
                                 net::OpeningLimits{8 + 4 + kMaxLabelBytes, 0}};
  l.limit = payload_limit;
  l.max_open = kMaxStreams;
  l.on_open = [raw = server.get()](const net::OpenRequest& r) { return raw->answer(r); };
  l.on_keep = [raw = server.get()](net::Accepted a) { raw->adopt(std::move(a)); };
  KVB_ASSIGN_OR_RETURN(server->listener_, net::Listener::start(std::move(l)));
  return server;
}

TcpServer::~TcpServer() {
  listener_.reset();  // no more adopt()
  stop_.store(true);
  {
    // Wakes every serving thread: its next poll sees the shutdown.
    std::lock_guard lock(conns_mutex_);
    for (auto& c : conns_) {
      if (c->fd) ::shutdown(c->fd.get(), SHUT_RDWR);
    }
  }
  for (auto& c : conns_) {
    if (c->thread.joinable()) c->thread.join();
  }
}

net::Answer TcpServer::answer(const net::OpenRequest& request) {
  uint64_t instance = 0;
  std::string label;
  if (Status s = decode_open_body(request.body, &instance, &label); !s.ok()) {
    return net::Answer::refuse(net::RefuseCode::kMalformed, "malformed: " + s.message());
  }
  if (instance != instance_) {
    return net::Answer::refuse(net::RefuseCode::kStale,
                               "tcp: this address belongs to another engine instance now (stale metadata?)");
  }
  std::lock_guard lock(conns_mutex_);
  if (per_peer_[label] >= kMaxStreamsPerPeer) {
    return net::Answer::refuse(net::RefuseCode::kBusy, "tcp: " + std::to_string(kMaxStreamsPerPeer) + " streams from " +
                                                           q(printable(label)) + " are open already");
  }
  return net::Answer::keep(kAccept, [&] {
    net::WireWriter w;
    w.str(label_);
    return w.take();
  }());
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

void TcpServer::adopt(net::Accepted a) {
  reap_finished();
  uint64_t instance = 0;
  auto conn = std::make_unique<Conn>();
  (void)decode_open_body(a.body, &instance, &conn->peer);  // checked by answer()
  net::tune_socket(a.fd.get(), true);
  conn->fd = std::move(a.fd);
  conn->slot = std::move(a.slot);
  conn->slot->set_reapable();
  Conn* raw = conn.get();
  std::lock_guard lock(conns_mutex_);
  if (stop_.load()) return;
  try {
    raw->thread = std::thread([this, raw, session = std::make_shared<net::Session>(std::move(a.session))]() mutable {
      serve(raw, std::move(*session));
    });
  } catch (const std::system_error&) {
    return;  // no thread to serve it: the stream closes, the client sees that
  }
  ++per_peer_[raw->peer];
  conns_.push_back(std::move(conn));
}

void TcpServer::add_segment(uint32_t id, uint64_t base, uint64_t bytes, uint8_t access, int device) {
  std::unique_lock lock(segments_mutex_);
  segments_[id] = SegmentSpan{base, bytes, access, device};
  device_segments_ = static_cast<size_t>(
      std::count_if(segments_.begin(), segments_.end(), [](const auto& s) { return s.second.device >= 0; }));
}

void TcpServer::set_staging(std::shared_ptr<StagingPool> pool, std::shared_ptr<DeviceSide> side,
                            DeviceRunOptions options) {
  std::unique_lock lock(segments_mutex_);
  staging_ = std::move(pool);
  device_side_ = std::move(side);
  device_options_ = options;
}

void TcpServer::remove_segment(uint32_t id) {
  std::unique_lock lock(segments_mutex_);
  auto it = segments_.find(id);
  if (it != segments_.end() && it->second.device >= 0) --device_segments_;
  if (it != segments_.end()) segments_.erase(it);
  epoch_.fetch_add(1);
}

void TcpServer::grant(uint64_t grant, std::string label, const GrantPlaces& places, bool read) {
  auto set = std::make_shared<const GrantSet>(places);  // outside the lock: sorting a large grant takes a while
  std::unique_lock lock(segments_mutex_);
  grant_labels_[grant] = {read, label};
  grants_[read ? 1 : 0][std::move(label)][grant] = std::move(set);
}

void TcpServer::share(uint64_t grant, std::string label, uint64_t like) {
  std::unique_lock lock(segments_mutex_);
  auto of = grant_labels_.find(like);
  if (of == grant_labels_.end()) return;
  const bool read = of->second.first;
  std::shared_ptr<const GrantSet> set = grants_[read ? 1 : 0][of->second.second][like];
  grant_labels_[grant] = {read, label};
  grants_[read ? 1 : 0][std::move(label)][grant] = std::move(set);
}

void TcpServer::revoke(uint64_t grant) {
  std::unique_lock lock(segments_mutex_);
  auto it = grant_labels_.find(grant);
  if (it == grant_labels_.end()) return;
  auto& grants = grants_[it->second.first ? 1 : 0];
  auto by_label = grants.find(it->second.second);
  if (by_label != grants.end()) {
    by_label->second.erase(grant);
    if (by_label->second.empty()) grants.erase(by_label);
  }
  grant_labels_.erase(it);
  epoch_.fetch_add(1);
}

Status TcpServer::check_granted_locked(const std::vector<Range>& ranges, const std::string& label, bool write) const {
  const auto& grants = grants_[write ? 0 : 1];
  const uint8_t by_grant = write ? kAccessByGrant : kAccessReadByGrant;
  std::vector<const GrantSet*> sets;  // the label's grants, gathered at the first range that needs one
  bool gathered = false;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    auto seg = segments_.find(r.segment);
    if (seg == segments_.end() || (seg->second.access & by_grant) == 0) continue;
    if (!gathered) {
      gathered = true;
      if (auto by_label = grants.find(label); by_label != grants.end()) {
        for (const auto& [id, set] : by_label->second) sets.push_back(set.get());
      }
    }
    if (!granted(sets, r.segment, r.address, r.bytes)) {
      return Status::permission_denied("tcp request: range " + std::to_string(i) + " [" + std::to_string(r.address) +
                                       ", +" + std::to_string(r.bytes) + ") of segment " + std::to_string(r.segment) +
                                       " is not inside a " + (write ? "write" : "read") + " grant to " +
                                       q(printable(label)) + " (it serves " + (write ? "writes" : "reads") +
                                       " only where granted)");
    }
  }
  return Status();
}

std::optional<SegmentSpan> TcpServer::lookup_locked(uint32_t id) const {
  auto it = segments_.find(id);
  if (it == segments_.end()) return std::nullopt;
  return it->second;
}

void TcpServer::serve(Conn* conn, net::Session session) {
  set_thread_name("kvb-tcp-serve");
  const int fd = conn->fd.get();
  const std::string peer = "'" + printable(conn->peer) + "'";
  net::FrameReader reader(net::Protocol::kTcp, kVersion, payload_limit);
  while (!stop_.load()) {
    // Idle between frames: the destructor's shutdown() wakes this wait.
    // Once a second it looks whether the listener reclaimed this idle
    // stream's place for a new client; then, or when a frame arrives after
    // that, the stream closes in order without reading it (net::Slot).
    conn->slot->idle();
    const Status waited = net::wait_fd(fd, POLLIN, net::IoLimits{Clock::now() + kReclaimCheck}, "tcp request");
    if (waited.code() == Code::kTimeout && !conn->slot->reclaimed()) continue;
    if (waited.code() != Code::kTimeout && !waited.ok()) break;
    if (!conn->slot->busy()) {
      close_reclaimed(fd);
      break;
    }
    Status s = net::read_frame(fd, reader, session, frame_limits(), "tcp serving " + peer);
    if (!s.ok()) break;  // the client sees the close and reports it
    const uint8_t type = reader.header().type;
    if (type != kRead && type != kWrite && type != kDigest) {
      // A stream that sent something else cannot be resynchronised: answer and close.
      std::string out;
      net::append_frame(out, {net::Protocol::kTcp, kError, kVersion, 0, false},
                        encode_error(Status::invalid_argument("tcp: unexpected frame type " + std::to_string(type))),
                        session);
      (void)net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
      break;
    }
    const Status served = type == kDigest ? serve_digest(fd, session, reader.payload(), *conn, peer)
                                          : serve_request(fd, session, type, reader.payload(), *conn, peer);
    if (!served.ok()) break;
  }
  std::lock_guard lock(conns_mutex_);
  auto it = per_peer_.find(conn->peer);
  if (it != per_peer_.end() && --it->second == 0) per_peer_.erase(it);
  conn->fd.reset();  // the client sees the end now, not when the thread is reaped
  conn->slot.reset();
  conn->finished.store(true);
}

Status TcpServer::serve_request(int fd, net::Session& session, uint8_t type, std::string_view payload, const Conn& conn,
                                const std::string& peer) {
  std::vector<Range> ranges;
  uint64_t total = 0;
  const bool is_write = type == kWrite;
  Status valid;
  {
    std::shared_lock lock(segments_mutex_);
    valid = decode_ranges(
        payload, [this](uint32_t id) { return lookup_locked(id); }, is_write, &ranges, &total);
    if (valid.ok()) valid = check_granted_locked(ranges, conn.peer, is_write);
  }
  std::string out;
  const uint32_t count = static_cast<uint32_t>(payload.size() / kRangeBytes);
  if (!valid.ok()) {
    if (is_write) {
      // Keep the stream in step: the bulk data that follows is read and
      // dropped, when its announced size is sane; else the stream closes.
      const Result<uint64_t> announced = announced_bytes(payload);
      net::append_frame(out, {net::Protocol::kTcp, kError, kVersion, 0, false}, encode_error(valid), session);
      if (!announced.ok()) {
        (void)net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
        return valid;
      }
      KVB_RETURN_IF_ERROR(drain(fd, *announced, peer));
      return net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
    }
    net::append_frame(out, {net::Protocol::kTcp, kError, kVersion, 0, false}, encode_error(valid), session);
    return net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
  }
  if (is_write) {
    KVB_RETURN_IF_ERROR(move_data(fd, false, ranges, {}, conn.peer, peer));
    net::append_frame(out, {net::Protocol::kTcp, kWriteAck, kVersion, 0, false}, encode_count(count), session);
    return net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
  }
  net::append_frame(out, {net::Protocol::kTcp, kReadData, kVersion, 0, false}, encode_count(count), session);
  return move_data(fd, true, ranges, out, conn.peer, peer);
}

Status TcpServer::serve_digest(int fd, net::Session& session, std::string_view payload, const Conn& conn,
                               const std::string& peer) {
  std::vector<Range> ranges;
  uint64_t total = 0;
  Status valid;
  {
    std::shared_lock lock(segments_mutex_);
    auto lookup = [this](uint32_t id) { return lookup_locked(id); };
    valid = decode_ranges(payload, lookup, false, &ranges, &total);
    if (valid.ok()) valid = check_granted_locked(ranges, conn.peer, false);
    // Not readable: a writer may still check what it wrote, where it may write.
    if (valid.code() == Code::kPermissionDenied) {
      ranges.clear();
      valid = decode_ranges(payload, lookup, true, &ranges, &total);
      if (valid.ok()) valid = check_granted_locked(ranges, conn.peer, true);
    }
  }
  std::string out;
  if (!valid.ok()) {
    net::append_frame(out, {net::Protocol::kTcp, kError, kVersion, 0, false}, encode_error(valid), session);
    return net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
  }
  // Hashed in pieces under the segments' shared lock, each after checking
  // that no segment was removed meanwhile (as move_data does); device
  // memory through a staging slot.
  const std::string who = "tcp serving " + peer;
  StagingPool::Lease slot;
  uint64_t piece = uint64_t{1} << 20;
  if (staging_) piece = std::min(piece, staging_->chunk_bytes());
  std::vector<uint64_t> hashes(ranges.size());
  ContentHasher hasher;
  const uint64_t validated_epoch = epoch_.load();
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    hasher.reset();
    for (uint64_t at = 0; at < r.bytes; at += piece) {
      if (stop_.load()) return Status::cancelled(who + ": the server is stopping");
      const uint64_t n = std::min(piece, r.bytes - at);
      std::shared_lock lock(segments_mutex_);
      std::optional<SegmentSpan> seg = lookup_locked(r.segment);
      if (epoch_.load() != validated_epoch) {
        if (!seg || r.address < seg->base || r.address + r.bytes > seg->base + seg->bytes) {
          return Status::unavailable(who + ": segment " + std::to_string(r.segment) + " was removed during a digest");
        }
      }
      if (seg && seg->device >= 0 && staging_) {
        if (!slot) {
          KVB_ASSIGN_OR_RETURN(slot, staging_->acquire(frame_limits().deadline, nullptr, who));
        }
        const Chunk one{n, {ChunkPiece{reinterpret_cast<uint8_t*>(r.address + at), r.address + at, n, r.segment, 0}}};
        KVB_RETURN_IF_ERROR(stage_chunk_locked(one, slot.data(), true, who));
        hasher.update(slot.data(), n);
      } else {
        hasher.update(reinterpret_cast<const void*>(r.address + at), n);
      }
    }
    hashes[i] = hasher.digest();
  }
  net::append_frame(out, {net::Protocol::kTcp, kDigestData, kVersion, 0, false}, encode_hashes(hashes), session);
  return net::send_bytes(fd, out.data(), out.size(), frame_limits(), "tcp reply");
}

Status TcpServer::revalidate_locked(const std::vector<Range>& ranges, const std::string& label, bool write,
                                    uint64_t* validated_epoch, const std::string& who) const {
  if (epoch_.load() == *validated_epoch) return Status();
  // A segment was removed or a grant revoked: the frame's ranges must
  // still be registered, and still granted where their segment asks.
  for (const Range& r : ranges) {
    std::optional<SegmentSpan> seg = lookup_locked(r.segment);
    if (!seg || r.address < seg->base || r.address + r.bytes > seg->base + seg->bytes)
      return Status::unavailable(who + ": segment " + std::to_string(r.segment) + " was removed during a transfer");
  }
  if (!check_granted_locked(ranges, label, write).ok()) {
    return Status::unavailable(
        who + (write ? ": a write grant was revoked during the write" : ": a read grant was revoked during the read"));
  }
  *validated_epoch = epoch_.load();
  return Status();
}

Status TcpServer::move_data(int fd, bool to_socket, const std::vector<Range>& ranges, const std::string& prefix,
                            const std::string& label, const std::string& peer) {
  {
    // Device segments go through staging; a server with none (host
    // memory only, the common case) looks at no range, and one with some
    // looks up each segment once.
    std::shared_lock lock(segments_mutex_);
    uint32_t seen = UINT32_MAX;
    for (size_t i = 0; device_segments_ > 0 && i < ranges.size(); ++i) {
      if (ranges[i].segment == seen) continue;
      seen = ranges[i].segment;
      std::optional<SegmentSpan> seg = lookup_locked(seen);
      if (seg && seg->device >= 0) {
        lock.unlock();
        return move_staged(fd, to_socket, ranges, prefix, label, peer);
      }
    }
  }
  net::IovCursor cursor;
  if (!prefix.empty()) cursor.push(const_cast<char*>(prefix.data()), prefix.size());
  for (const Range& r : ranges) cursor.push(reinterpret_cast<void*>(r.address), r.bytes);
  uint64_t validated_epoch = epoch_.load();
  const net::IoLimits limits = frame_limits();
  const std::string who = "tcp serving " + peer;
  while (!cursor.done()) {
    size_t moved = 0;
    {
      std::shared_lock lock(segments_mutex_);
      KVB_RETURN_IF_ERROR(revalidate_locked(ranges, label, !to_socket, &validated_epoch, who));
      KVB_ASSIGN_OR_RETURN(moved, to_socket ? net::send_step(fd, cursor, who) : net::recv_step(fd, cursor, who));
    }
    if (moved == 0) KVB_RETURN_IF_ERROR(net::wait_fd(fd, to_socket ? POLLOUT : POLLIN, limits, who));
  }
  return Status();
}

Status TcpServer::move_staged(int fd, bool to_socket, const std::vector<Range>& ranges, const std::string& prefix,
                              const std::string& label, const std::string& peer) {
  const std::string who = "tcp serving " + peer;
  const net::IoLimits limits = frame_limits();
  if (!staging_) return Status::internal(who + ": a device segment without a staging pool");
  std::vector<Copy> copies;
  copies.reserve(ranges.size());
  for (const Range& r : ranges)
    copies.push_back(Copy{reinterpret_cast<uint8_t*>(r.address), r.address, r.bytes, r.segment});
  const std::vector<Chunk> chunks = pack_chunks(copies, staging_->chunk_bytes());
  uint64_t validated_epoch = epoch_.load();
  KVB_ASSIGN_OR_RETURN(StagingPool::Lease slot, staging_->acquire(limits.deadline, nullptr, who));
  if (!prefix.empty()) KVB_RETURN_IF_ERROR(net::send_bytes(fd, prefix.data(), prefix.size(), limits, who));
  for (const Chunk& k : chunks) {
    if (stop_.load()) return Status::cancelled(who + ": the server is stopping");
    if (!to_socket) KVB_RETURN_IF_ERROR(net::recv_bytes(fd, slot.data(), k.bytes, limits, who));
    {
      std::shared_lock lock(segments_mutex_);
      KVB_RETURN_IF_ERROR(revalidate_locked(ranges, label, !to_socket, &validated_epoch, who));
      KVB_RETURN_IF_ERROR(stage_chunk_locked(k, slot.data(), to_socket, who));
    }
    if (to_socket) KVB_RETURN_IF_ERROR(net::send_bytes(fd, slot.data(), k.bytes, limits, who));
  }
  return Status();
}

Status TcpServer::stage_chunk_locked(const Chunk& k, uint8_t* slot, bool to_slot, const std::string& who) {
  std::map<int, std::vector<device::DeviceCopy>> by_device;
  for (const ChunkPiece& p : k.pieces) {
    std::optional<SegmentSpan> seg = lookup_locked(p.segment);
    uint8_t* staged = slot + p.at;
    if (seg && seg->device >= 0) {
      by_device[seg->device].push_back(to_slot ? device::DeviceCopy{staged, p.local, p.bytes}
                                               : device::DeviceCopy{p.local, staged, p.bytes});
    } else if (to_slot) {
      std::memcpy(staged, p.local, p.bytes);
    } else {
      std::memcpy(p.local, staged, p.bytes);
    }
  }
  device::Device& device = device_side_->device();
  std::vector<StreamPool::Slot*> queued;
  Status out;
  for (const auto& [d, batch] : by_device) {
    Result<StreamPool::Slot*> s = device_side_->pool().acquire(d);
    if (!s.ok()) {
      out = s.error();
      break;
    }
    queued.push_back(*s);
    out = device.copy((*s)->stream, batch, choose_method(device_options_, batch), device_options_.max_blocks);
    if (out.ok()) out = device.record((*s)->events[0], (*s)->stream);
    if (!out.ok()) {
      queued.pop_back();
      device_side_->pool().release(*s);
      break;
    }
  }
  count_staged_chunk();
  // What was queued completes before the lock goes: a removed segment or a
  // revoked grant is never touched after remove_segment() or revoke().
  for (StreamPool::Slot* s : queued) {
    Status done = await_event(device, s->events[0], nullptr);
    if (out.ok()) out = done;
    device_side_->pool().release(s);
  }
  return out.with_context(who + ": staging device memory");
}

Status TcpServer::drain(int fd, uint64_t bytes, const std::string& peer) {
  std::vector<uint8_t> scratch(std::min<uint64_t>(bytes, 1 << 16));
  const net::IoLimits limits = frame_limits();
  while (bytes > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, scratch.size()));
    KVB_RETURN_IF_ERROR(net::recv_bytes(fd, scratch.data(), n, limits, "tcp serving " + peer));
    bytes -= n;
  }
  return Status();
}

}  // namespace kvbridge::transport::tcp

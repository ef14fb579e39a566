// Control connections: inbound notification readers and outbound channels,
// polled by one thread; the listener (net/listener.h) runs the opening
// exchange before a connection reaches it.
//
// Sockets are non-blocking. Frames to a peer are queued on its channel and
// written by whichever thread gets there first under the channel's lock (the
// caller of notify() tries at once; the control thread finishes on POLLOUT),
// with MSG_NOSIGNAL so a vanished peer is EPIPE, not SIGPIPE (send(2)). No
// thread ever waits for an acknowledgement: pending notifications sit in a
// map by sequence number until their Ack, their deadline (the control
// thread's poll timeout), or the end of the channel.
#include "engine/control.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <future>

#include "common/text.h"
#include "common/thread_name.h"
#include "engine/metadata.h"
#include "net/opening.h"
#include "net/socket.h"
#include "net/wire.h"

namespace kvbridge::engine_internal {
namespace {

constexpr uint8_t kAccept = 16, kNotify = 17, kAck = 18;
constexpr size_t kMaxOpenBody = 4 + kMaxNameBytes + 24;
constexpr size_t kMaxInboundOut = 64 << 10;  // unsent Acks before a peer that does not read is dropped

net::OpeningConfig opening(const ControlOptions& o) {
  return net::OpeningConfig{net::Protocol::kControl, kControlVersion, o.secret, net::OpeningLimits{kMaxOpenBody, 0}};
}

std::string encode_identity(const ControlIdentity& id, uint64_t target) {
  net::WireWriter w;
  w.str(id.name);
  w.u64(id.instance);
  w.u64(id.pid);
  w.u64(target);
  return w.take();
}

Status decode_identity(std::string_view body, ControlIdentity* id, uint64_t* target) {
  net::WireReader r(body, "control Open body");
  KVB_RETURN_IF_ERROR(r.str("name", kMaxNameBytes, &id->name));
  KVB_RETURN_IF_ERROR(r.u64("instance", &id->instance));
  KVB_RETURN_IF_ERROR(r.u64("pid", &id->pid));
  KVB_RETURN_IF_ERROR(r.u64("target", target));
  if (id->name.empty() || id->instance == 0) return r.error("an empty name or a zero instance");
  return r.finish();
}

std::string u64_payload(uint64_t v) {
  net::WireWriter w;
  w.u64(v);
  return w.take();
}

// Writes what it can of out[pos...] without blocking. False on an error.
bool flush(int fd, std::string& out, size_t& pos) {
  while (pos < out.size()) {
    const ssize_t n = ::send(fd, out.data() + pos, out.size() - pos, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0) return false;
    pos += static_cast<size_t>(n);
  }
  if (pos == out.size()) {
    out.clear();
    pos = 0;
  } else if (pos > (1 << 16)) {
    out.erase(0, pos);
    pos = 0;
  }
  return true;
}

}  // namespace

size_t control_payload_limit(uint8_t type) {
  switch (type) {
    case kAccept:
      return 8;
    case kNotify:
      return 8 + kMaxControlPayload;
    case kAck:
      return 8 + kMaxNotificationAnswerBytes;
  }
  return net::opening_limit(type, net::OpeningLimits{kMaxOpenBody, 0});
}

struct Control::Inbound {
  net::Fd fd;
  net::Session session;
  ControlIdentity who;
  std::string address;
  net::FrameReader reader{net::Protocol::kControl, kControlVersion, control_payload_limit};
  std::string out;
  size_t out_pos = 0;
  std::shared_ptr<void> slot;
};

// --- Channel.

std::vector<Channel::Done> Channel::end_locked(const Status& why) {
  std::vector<Done> out;
  if (!gone_.ok()) return out;
  gone_ = why;
  for (auto& [seq, p] : pending_) out.push_back(std::move(p.done));
  pending_.clear();
  ::shutdown(fd_.get(), SHUT_RDWR);
  return out;
}

Status Channel::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gone_;
}

void Channel::notify(std::string message, Clock::time_point deadline, std::function<void(Status)> done, bool drop) {
  notify(
      std::move(message), deadline, [done = std::move(done)](Status s, std::string) { done(std::move(s)); }, drop);
}

void Channel::notify(std::string message, Clock::time_point deadline, Done done, bool drop) {
  if (message.size() > kMaxControlPayload) {
    return done(Status::resource_exhausted("notification is " + std::to_string(message.size()) + " bytes, more than " +
                                           std::to_string(kMaxControlPayload)),
                {});
  }
  Status failed;
  std::vector<Done> fail;  // when a send error ends the channel here
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!gone_.ok()) {
      failed = gone_;
    } else if (out_.size() - out_pos_ > kMaxQueuedBytes) {
      failed = Status::resource_exhausted("peer " + peer_ + " is not reading its control connection (" +
                                          std::to_string(out_.size() - out_pos_) + " bytes queued)");
    } else {
      const uint64_t seq = ++next_seq_;
      pending_.emplace(seq, Pending{deadline, std::move(done)});
      if (!drop) {
        net::WireWriter w;
        w.u64(seq);
        w.raw(message);
        net::append_frame(out_, {net::Protocol::kControl, kNotify, kControlVersion, 0, false}, w.out(), session_);
        // Written at once when the socket takes it: no wake-up on the way.
        if (!flush(fd_.get(), out_, out_pos_)) {
          fail = end_locked(Status::io_error("peer " + peer_ + " is gone: send: " + errno_text(errno)));
          failed = gone_;
        }
      }
    }
  }
  if (!fail.empty()) {
    for (auto& f : fail) f(failed, {});
  } else if (!failed.ok()) {
    return done(failed, {});
  }
  // The control thread watches the deadline, writes what is left and, after
  // a failed send, tells the engine the peer is gone.
  control_->wake();
}

Status Channel::notify_and_wait(std::string message, Clock::time_point deadline, bool drop) {
  auto result = std::make_shared<std::promise<Status>>();
  std::future<Status> f = result->get_future();
  notify(
      std::move(message), deadline, [result](Status s) { result->set_value(std::move(s)); }, drop);
  return f.get();
}

// --- Control.

Result<std::unique_ptr<Control>> Control::create(ControlOptions options,
                                                 std::function<std::string(Notification)> on_notification) {
  std::unique_ptr<Control> c(new Control());
  c->options_ = std::move(options);
  c->on_notification_ = std::move(on_notification);
  c->wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!c->wake_fd_) return Status::io_error("control: eventfd: " + errno_text(errno));
  KVB_ASSIGN_OR_RETURN(net::HostPort bind, net::parse_host(c->options_.host, "control listener host"));
  net::ListenerOptions l;
  l.name = "control listener";
  l.thread_name = "kvb-ctl-listen";
  l.bind = bind;
  l.opening = opening(c->options_);
  l.limit = control_payload_limit;
  l.max_open = kMaxInbound;
  l.open_timeout = c->options_.open_timeout;
  l.on_open = [raw = c.get()](const net::OpenRequest& r) { return raw->answer(r); };
  l.on_keep = [raw = c.get()](net::Accepted a) { raw->adopt(std::move(a)); };
  KVB_ASSIGN_OR_RETURN(c->listener_, net::Listener::start(std::move(l)));
  try {
    c->thread_ = std::thread([raw = c.get()] { raw->loop(); });
  } catch (const std::system_error& e) {
    return Status::resource_exhausted(std::string("control: cannot start its thread: ") + e.what());
  }
  return c;
}

Control::~Control() {
  listener_.reset();  // no more adopt()
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  for (auto& ch : channels_) end_channel(*ch, Status::io_error("engine is shutting down"), false);
}

std::string Control::address() const {
  net::HostPort at = listener_->address();
  if (!options_.advertise_host.empty()) at.host = options_.advertise_host;
  return net::format_host_port(at);
}

void Control::wake() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));  // a full counter already wakes
}

net::Answer Control::answer(const net::OpenRequest& request) {
  ControlIdentity who;
  uint64_t target = 0;
  if (Status s = decode_identity(request.body, &who, &target); !s.ok()) {
    return net::Answer::refuse(net::RefuseCode::kMalformed, "malformed: " + s.message());
  }
  if (target != options_.self.instance) {
    return net::Answer::refuse(net::RefuseCode::kStale, "control connection: this address belongs to engine '" +
                                                            options_.self.name + "' instance " +
                                                            hex16(options_.self.instance) + ", not " + hex16(target) +
                                                            " (stale metadata?)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (per_peer_[{who.name, who.instance}] >= kMaxInboundPerPeer) {
    return net::Answer::refuse(net::RefuseCode::kBusy, "control connection: engine '" + printable(who.name) +
                                                           "' already has " + std::to_string(kMaxInboundPerPeer) +
                                                           " connections open here");
  }
  return net::Answer::keep(kAccept, u64_payload(options_.self.instance));
}

void Control::adopt(net::Accepted accepted) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    adopted_.push_back(std::move(accepted));
  }
  wake();
}

Result<std::shared_ptr<Channel>> Control::connect(const std::string& address, uint64_t instance,
                                                  const std::string& peer, std::function<void(const Status&)> on_gone) {
  const std::string who = "control connection to peer " + peer + " at " + address;
  KVB_ASSIGN_OR_RETURN(net::HostPort to, net::parse_host_port(address, "control address"));
  const net::IoLimits limits{Clock::now() + options_.open_timeout, nullptr, nullptr};
  KVB_ASSIGN_OR_RETURN(net::Dialed dialed,
                       net::dial_and_open(to, opening(options_), encode_identity(options_.self, instance),
                                          control_payload_limit, limits, who));
  net::Fd fd = std::move(dialed.fd);
  net::Opened opened = std::move(dialed.opened);
  net::WireReader r(opened.payload, "control Accept");
  uint64_t theirs = 0;
  if (opened.header.type != kAccept || !r.u64("instance", &theirs).ok() || !r.finish().ok() || theirs != instance) {
    return Status::io_error(who + ": the peer did not accept as engine instance " + hex16(instance));
  }
  std::shared_ptr<Channel> ch(new Channel(this, std::move(fd), std::move(opened.session), peer, std::move(on_gone)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return Status::unavailable("engine is shutting down");
    channels_.push_back(ch);
  }
  wake();
  return ch;
}

void Control::close(const std::shared_ptr<Channel>& channel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    channels_.erase(std::remove(channels_.begin(), channels_.end(), channel), channels_.end());
  }
  end_channel(*channel, Status::unavailable("connection to peer " + channel->peer() + " was closed"), false);
  wake();
}

void Control::end_channel(Channel& ch, const Status& why, bool report) {
  std::vector<Channel::Done> fail;
  bool fire = false;
  Status gone;
  {
    std::lock_guard<std::mutex> lock(ch.mu_);
    fail = ch.end_locked(why);
    gone = ch.gone_;
    fire = report && !ch.gone_reported_;
    ch.gone_reported_ = true;
  }
  for (auto& f : fail) f(gone, {});
  if (fire && ch.on_gone_) ch.on_gone_(gone);
}

bool Control::read_inbound(Inbound& in) {
  char buf[65536];
  while (true) {
    const size_t want = std::min(sizeof buf, in.reader.wanted());
    const ssize_t n = ::recv(in.fd.get(), buf, want, MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (!in.reader.feed(std::string_view(buf, static_cast<size_t>(n))).ok()) return false;
    if (!in.reader.ready()) continue;
    const net::FrameHeader& h = in.reader.header();
    if (h.tagged != in.session.keyed()) return false;
    if (in.session.keyed() && !in.session.check(in.reader.raw_header(), in.reader.payload(), in.reader.tag()))
      return false;
    if (h.type != kNotify) return false;
    net::WireReader r(in.reader.payload(), "Notify");
    uint64_t seq = 0;
    if (!r.u64("seq", &seq).ok()) return false;
    std::string_view message;
    (void)r.raw("message", r.left(), &message);
    std::string answer = on_notification_(Notification{in.who.name, std::string(message), in.who.instance});
    if (answer.size() > kMaxNotificationAnswerBytes) answer.resize(kMaxNotificationAnswerBytes);
    net::WireWriter ack;
    ack.u64(seq);
    ack.raw(answer);
    net::append_frame(in.out, {net::Protocol::kControl, kAck, kControlVersion, 0, false}, ack.out(), in.session);
    in.reader.next();
    if (!flush(in.fd.get(), in.out, in.out_pos) || in.out.size() - in.out_pos > kMaxInboundOut) return false;
  }
}

bool Control::read_channel(Channel& ch) {
  char buf[4096];
  while (true) {
    const size_t want = std::min(sizeof buf, ch.reader_.wanted());
    const ssize_t n = ::recv(ch.fd_.get(), buf, want, MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (!ch.reader_.feed(std::string_view(buf, static_cast<size_t>(n))).ok()) return false;
    if (!ch.reader_.ready()) continue;
    // Acks only, each with its answer.
    const net::FrameHeader& h = ch.reader_.header();
    if (h.type != kAck || h.tagged != ch.session_.keyed()) return false;
    if (ch.session_.keyed() && !ch.session_.check(ch.reader_.raw_header(), ch.reader_.payload(), ch.reader_.tag())) {
      return false;
    }
    net::WireReader r(ch.reader_.payload(), "Ack");
    uint64_t seq = 0;
    if (!r.u64("seq", &seq).ok()) return false;
    std::string_view answer;
    (void)r.raw("answer", r.left(), &answer);
    Channel::Done done;
    {
      std::lock_guard<std::mutex> lock(ch.mu_);
      auto it = ch.pending_.find(seq);
      if (it != ch.pending_.end()) {  // else a late Ack of an expired one
        done = std::move(it->second.done);
        ch.pending_.erase(it);
      }
    }
    std::string answered(answer);
    ch.reader_.next();
    if (done) done(Status(), std::move(answered));
  }
}

bool Control::write_channel(Channel& ch) {
  std::lock_guard<std::mutex> lock(ch.mu_);
  return flush(ch.fd_.get(), ch.out_, ch.out_pos_);
}

void Control::expire(Channel& ch, Clock::time_point now) {
  std::vector<Channel::Done> late;
  {
    std::lock_guard<std::mutex> lock(ch.mu_);
    for (auto it = ch.pending_.begin(); it != ch.pending_.end();) {
      if (it->second.deadline <= now) {
        late.push_back(std::move(it->second.done));
        it = ch.pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& f : late) {
    f(Status::timeout("peer " + ch.peer_ + " did not acknowledge the notification before the deadline"), {});
  }
}

void Control::loop() {
  set_thread_name("kvb-control");
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Channel>> channels;
  while (true) {
    std::vector<net::Accepted> adopted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      channels = channels_;
      adopted.swap(adopted_);
    }
    for (net::Accepted& a : adopted) {
      auto in = std::make_unique<Inbound>();
      ControlIdentity who;
      uint64_t target = 0;
      (void)decode_identity(a.body, &who, &target);  // checked by answer()
      in->who = who;
      in->fd = std::move(a.fd);
      in->session = std::move(a.session);
      in->address = a.peer_address;
      in->slot = std::move(a.slot);
      std::lock_guard<std::mutex> lock(mu_);
      ++per_peer_[{who.name, who.instance}];
      inbound_.push_back(std::move(in));
    }
    const Clock::time_point now = Clock::now();
    Clock::time_point next = now + std::chrono::seconds(60);
    fds.clear();
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    for (auto& in : inbound_) {
      fds.push_back({in->fd.get(), static_cast<short>(POLLIN | (in->out.empty() ? 0 : POLLOUT)), 0});
    }
    for (auto& ch : channels) {
      std::lock_guard<std::mutex> lock(ch->mu_);
      fds.push_back({ch->fd_.get(), static_cast<short>(POLLIN | (ch->out_.empty() ? 0 : POLLOUT)), 0});
      for (const auto& [seq, p] : ch->pending_) next = std::min(next, p.deadline);
    }
    if (::poll(fds.data(), fds.size(), net::poll_timeout_ms(next, 60000)) < 0 && errno != EINTR) continue;
    if (fds[0].revents) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_.get(), &v, sizeof(v));
    }
    const size_t num_inbound = inbound_.size();
    for (size_t i = num_inbound; i-- > 0;) {
      Inbound& in = *inbound_[i];
      const short ev = fds[1 + i].revents;
      bool ok = true;
      if (ev & POLLOUT) ok = flush(in.fd.get(), in.out, in.out_pos);
      if (ok && (ev & (POLLIN | POLLHUP | POLLERR))) ok = read_inbound(in);
      if (ok) continue;
      std::lock_guard<std::mutex> lock(mu_);
      auto it = per_peer_.find({in.who.name, in.who.instance});
      if (it != per_peer_.end() && --it->second == 0) per_peer_.erase(it);
      inbound_.erase(inbound_.begin() + static_cast<ptrdiff_t>(i));
    }
    const Clock::time_point after = Clock::now();
    for (size_t j = 0; j < channels.size(); ++j) {
      Channel& ch = *channels[j];
      const short ev = fds[1 + num_inbound + j].revents;
      bool open = true;
      if (ev & POLLOUT) open = write_channel(ch);
      if (open && (ev & (POLLIN | POLLHUP | POLLERR))) open = read_channel(ch);
      if (!open) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          channels_.erase(std::remove(channels_.begin(), channels_.end(), channels[j]), channels_.end());
        }
        end_channel(ch, Status::io_error("peer " + ch.peer_ + " is gone: its control connection closed"), true);
        continue;
      }
      expire(ch, after);
      if (!ch.health().ok()) {
        // Ended by a failed send on another thread: report it here, once.
        {
          std::lock_guard<std::mutex> lock(mu_);
          channels_.erase(std::remove(channels_.begin(), channels_.end(), channels[j]), channels_.end());
        }
        end_channel(ch, ch.health(), true);
      }
    }
  }
}

}  // namespace kvbridge::engine_internal

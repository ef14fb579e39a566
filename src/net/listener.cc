// The bounded, authenticated listener (see listener.h).
//
// One thread polls the listening socket, an eventfd the destructor writes,
// and every connection still opening. A connection reads exactly the bytes
// of the frame it expects (FrameReader), so a client cannot make it buffer
// more than one bounded frame. After a final answer (a Refuse or a reply) it
// shuts down its sending side and reads until the client closes, bounded by
// the deadline: closing a socket with unread input sends a RST (RFC 1122
// 4.2.2.13), which could destroy the answer before the client reads it.
#include "net/listener.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <tuple>

#include "common/text.h"
#include "common/thread_name.h"
#include "net/socket.h"

namespace kvbridge::net {

using Clock = std::chrono::steady_clock;

struct Listener::Conn {
  enum class State { kRead, kWrite, kLinger, kClosed };
  Fd fd;
  std::string peer;
  Clock::time_point deadline;
  State state = State::kRead;
  FrameReader reader;
  ServerOpening opening;
  std::string out;
  size_t out_pos = 0;
  bool final = false;  // after `out`: linger and close
  bool keep = false;   // after `out`: hand over to on_keep
  Session session;
  bool decided = false;   // counted in stats already
  uint32_t frames = 0;    // whole frames received: how far the opening got
  uint64_t received = 0;  // bytes received
  Clock::time_point accepted_at;
  std::shared_ptr<std::atomic<size_t>> source_open;  // a kept connection's source count
  Conn(const ListenerOptions& o) : reader(o.opening.protocol, o.opening.version, o.limit), opening(o.opening) {}
};

Listener::Listener(ListenerOptions options)
    : options_(std::move(options)), own_source_("uid " + std::to_string(::geteuid()) + " on this host") {}

Result<std::unique_ptr<Listener>> Listener::start(ListenerOptions options) {
  if (!options.on_open || !options.limit)
    return Status::invalid_argument(options.name + ": on_open and limit are required");
  if (options.max_pending == 0 || options.max_open == 0 || options.open_timeout.count() <= 0) {
    return Status::invalid_argument(options.name + ": max_pending, max_open and open_timeout must be positive");
  }
  std::unique_ptr<Listener> l(new Listener(std::move(options)));
  KVB_ASSIGN_OR_RETURN(Listening listening, listen_on(l->options_.bind, l->options_.backlog, l->options_.name));
  l->listen_fd_ = std::move(listening.fd);
  l->address_ = listening.bound;
  // The kernel hands over a connection once its first bytes arrived (or
  // once its deferral ran out, about a second): a real client is never seen
  // before its Open, so a flood cannot close it as silent.
  const int defer_s = static_cast<int>(kDeferAccept.count());
  if (::setsockopt(l->listen_fd_.get(), IPPROTO_TCP, TCP_DEFER_ACCEPT, &defer_s, sizeof defer_s) != 0) {
    return Status::io_error(l->options_.name + ": setsockopt(TCP_DEFER_ACCEPT): " + errno_text(errno));
  }
  l->wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!l->wake_fd_) return Status::io_error(l->options_.name + ": eventfd: " + errno_text(errno));
  try {
    l->thread_ = std::thread([raw = l.get()] { raw->loop(); });
  } catch (const std::system_error& e) {
    return Status::resource_exhausted(l->options_.name + ": cannot start its thread: " + e.what());
  }
  return l;
}

Listener::~Listener() {
  stop_ = true;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

ListenerStats Listener::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ListenerStats s = stats_;
  s.open = open_->load();
  return s;
}

void Listener::note_failure(const Conn& c, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.last_failure = "client " + c.peer + ": " + why;
}

void Listener::loop() {
  set_thread_name(options_.thread_name);
  std::vector<pollfd> fds;
  while (!stop_.load()) {
    const Clock::time_point now = Clock::now();
    const bool paused = now < paused_until_;
    fds.clear();
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    fds.push_back({listen_fd_.get(), static_cast<short>(paused ? 0 : POLLIN), 0});
    Clock::time_point next = now + std::chrono::seconds(10);
    if (paused) next = std::min(next, paused_until_);
    for (auto& c : conns_) {
      fds.push_back({c->fd.get(), static_cast<short>(c->state == Conn::State::kWrite ? POLLOUT : POLLIN), 0});
      next = std::min(next, c->deadline);
    }
    const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(next, 10000));
    if (n < 0 && errno != EINTR) break;  // only EFAULT/EINVAL/ENOMEM: nothing to retry
    if (stop_.load()) break;
    // Connections accepted now join the next round; step the polled ones.
    const size_t polled = fds.size() - 2;
    for (size_t i = 0; n > 0 && i < polled; ++i) {
      if (fds[i + 2].revents != 0) step(*conns_[i], fds[i + 2].revents);
    }
    if (n > 0 && (fds[1].revents & POLLIN)) accept_all();
    const Clock::time_point after = Clock::now();
    for (auto& c : conns_) {
      if (c->state != Conn::State::kClosed && after >= c->deadline) {
        if (c->state == Conn::State::kLinger) {
          c->state = Conn::State::kClosed;
        } else {
          abandon(*c,
                  "opening exchange did not finish within " + std::to_string(options_.open_timeout.count()) + " ms");
        }
      }
    }
    std::erase_if(conns_, [](const std::unique_ptr<Conn>& c) { return c->state == Conn::State::kClosed; });
    std::lock_guard<std::mutex> lock(mu_);
    stats_.pending = conns_.size();
  }
}

void Listener::accept_all() {
  // At most half the table per round: every connection is polled at least
  // once (and its first frame read) before newer ones can push it out.
  const size_t per_round = std::max<size_t>(1, options_.max_pending / 2);
  for (size_t accepted = 0; accepted < per_round; ++accepted) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    const int fd = ::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (is_resource_errno(errno)) {
        // Out of descriptors or memory: pause rather than spin on a
        // listening socket that stays readable.
        paused_until_ = Clock::now() + kAcceptBackoff;
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.accept_pauses;
        stats_.last_failure = options_.name + ": accept: " + errno_text(errno) + " (pausing " +
                              std::to_string(kAcceptBackoff.count()) + " ms)";
      }
      return;  // EAGAIN, or a connection that died in the backlog
    }
    tune_socket(fd, false);
    if (conns_.size() >= options_.max_pending) {
      // Room is made by the connection that got least far, the oldest of
      // those: an idle client (no frame sent) never pushes out one that is
      // in the middle of its opening exchange.
      auto victim = std::min_element(conns_.begin(), conns_.end(), [](const auto& a, const auto& b) {
        const auto rank = [](const Conn& c) {
          return std::make_tuple(c.state != Conn::State::kClosed, c.state != Conn::State::kLinger, c.frames,
                                 c.received != 0, c.deadline);
        };
        return rank(*a) < rank(*b);
      });
      // A victim that has sent nothing yet but was accepted within the
      // grace keeps its place against a newcomer that has nothing to say
      // either: the newcomer goes.
      const auto now = Clock::now();
      const auto grace = std::min(options_.idle_grace, options_.open_timeout / 2);
      if (victim != conns_.end() && (*victim)->state == Conn::State::kRead && (*victim)->received == 0 &&
          now - (*victim)->accepted_at < grace) {
        char byte;
        const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n <= 0) {
          ::close(fd);
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.accepted;
          ++stats_.evicted;
          ++stats_.abandoned;
          stats_.last_failure = "client " + sockaddr_text(ss) +
                                ": closed at once: " + std::to_string(options_.max_pending) +
                                " connections were opening and it had sent nothing";
          continue;
        }
      }
      if (victim != conns_.end()) {
        if ((*victim)->state == Conn::State::kLinger) {
          (*victim)->state = Conn::State::kClosed;
        } else if ((*victim)->state != Conn::State::kClosed) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            ++stats_.evicted;
          }
          abandon(**victim, "closed for a newer connection: " + std::to_string(options_.max_pending) +
                                " connections were opening");
        }
        conns_.erase(victim);
      }
    }
    auto c = std::make_unique<Conn>(options_);
    c->fd.reset(fd);
    c->peer = sockaddr_text(ss);
    c->accepted_at = Clock::now();
    c->deadline = c->accepted_at + options_.open_timeout;
    conns_.push_back(std::move(c));
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.accepted;
  }
}

void Listener::abandon(Conn& c, const std::string& why) {
  if (!c.decided) {
    note_failure(c, why);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.abandoned;
  }
  c.decided = true;
  c.state = Conn::State::kClosed;
}

void Listener::send(Conn& c, std::string bytes, bool final) {
  c.out = std::move(bytes);
  c.out_pos = 0;
  c.final = final;
  c.state = Conn::State::kWrite;
  step(c, POLLOUT);
}

void Listener::refuse(Conn& c, const Refusal& refusal) {
  if (!c.decided) {
    note_failure(c, refusal.message);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.refused;
  }
  c.decided = true;
  std::string out;
  FrameHeader h{options_.opening.protocol, kRefuse, options_.opening.version, 0, false};
  append_frame(out, h, encode_refusal(refusal, options_.opening.limits.max_detail), c.session);
  send(c, std::move(out), true);
}

void Listener::step(Conn& c, short revents) {
  using State = Conn::State;
  if (c.state == State::kWrite) {
    while (c.out_pos < c.out.size()) {
      const ssize_t n =
          ::send(c.fd.get(), c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0) return abandon(c, "send: " + errno_text(errno));
      c.out_pos += static_cast<size_t>(n);
    }
    c.out.clear();
    if (c.keep) {
      Accepted a;
      a.fd = std::move(c.fd);
      a.session = std::move(c.session);
      a.peer_address = c.peer;
      a.body = c.opening.body();
      a.slot = std::make_shared<Slot>(open_, std::move(c.source_open));
      slots_.erase(std::remove_if(slots_.begin(), slots_.end(), [](const auto& w) { return w.expired(); }),
                   slots_.end());
      slots_.push_back(a.slot);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.kept;
      }
      c.state = State::kClosed;
      options_.on_keep(std::move(a));
      return;
    }
    if (c.final) {
      ::shutdown(c.fd.get(), SHUT_WR);
      c.state = State::kLinger;
      return;
    }
    c.state = State::kRead;
    return;
  }
  if (c.state == State::kLinger) {
    char sink[4096];
    const ssize_t n = ::recv(c.fd.get(), sink, sizeof sink, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c.state = State::kClosed;
    return;
  }
  if (c.state != State::kRead) return;
  if (revents & (POLLERR | POLLNVAL)) return abandon(c, "connection failed");
  char buf[65536];
  const size_t want = std::min(sizeof buf, c.reader.wanted());
  const ssize_t n = ::recv(c.fd.get(), buf, want, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n == 0) {
    return abandon(c, c.reader.buffered() == 0 ? "client closed the connection during the opening exchange"
                                               : "client closed the connection in the middle of a frame (after " +
                                                     std::to_string(c.reader.buffered()) + " bytes)");
  }
  if (n < 0) return abandon(c, "receive: " + errno_text(errno));
  c.received += static_cast<uint64_t>(n);
  if (Status fed = c.reader.feed(std::string_view(buf, static_cast<size_t>(n))); !fed.ok()) {
    Protocol old = Protocol::kSideChannel;
    uint16_t old_version = 0;
    if (legacy_header(c.reader.raw_header(), &old, &old_version) && old == options_.opening.protocol) {
      if (options_.legacy_reply) {
        std::string reply = options_.legacy_reply(old, old_version);
        note_failure(c, fed.message());
        {
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.refused;
        }
        c.decided = true;
        if (!reply.empty()) return send(c, std::move(reply), true);
      }
      return abandon(c, fed.message());
    }
    const RefuseCode code = fed.code() == Code::kIncompatible ? RefuseCode::kVersion : RefuseCode::kMalformed;
    return refuse(c, Refusal{code, code == RefuseCode::kMalformed ? "malformed: " + fed.message() : fed.message(), {}});
  }
  if (c.reader.ready()) on_frame(c);
}

void Listener::on_frame(Conn& c) {
  ++c.frames;
  ServerOpening::Step s = c.opening.on_frame(c.reader.header(), c.reader.raw_header(), c.reader.payload());
  c.reader.next();
  switch (s.kind) {
    case ServerOpening::Step::Kind::kSend:
      return send(c, std::move(s.bytes), false);
    case ServerOpening::Step::Kind::kRefuse:
      return refuse(c, s.refusal);
    case ServerOpening::Step::Kind::kOpened:
      return answer(c);
  }
}

void Listener::answer(Conn& c) {
  c.session = c.opening.take_session();
  OpenRequest request{c.peer, c.opening.body(), c.session.keyed()};
  Answer a = options_.on_open(request);
  if (a.kind == Answer::Kind::kKeep) {
    // One source's share first (its own idle connection makes room), then
    // the listener's bound.
    const std::string source = connection_source(c.fd.get());
    if (sources_.size() > 1024) {
      for (auto it = sources_.begin(); it != sources_.end();) {
        it = it->second->load() == 0 && it->second.use_count() == 1 ? sources_.erase(it) : std::next(it);
      }
    }
    std::shared_ptr<std::atomic<size_t>>& counter = sources_[source];
    if (!counter) counter = std::make_shared<std::atomic<size_t>>(0);
    const size_t share = max_open_per_source();
    if (source != own_source_ && counter->load() >= share && !reclaim_idle(counter.get())) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.refused_source;
      }
      a = Answer::refuse(RefuseCode::kBusy, options_.name + " is busy: " + source + " holds " + std::to_string(share) +
                                                " connections, the most one source may; try again later");
    } else if (open_->load() >= options_.max_open && !reclaim_idle()) {
      a = Answer::refuse(RefuseCode::kBusy, options_.name + " is busy: " + std::to_string(options_.max_open) +
                                                " connections are open; try again later");
    } else {
      c.source_open = counter;
    }
  }
  if (a.kind == Answer::Kind::kRefuse) return refuse(c, a.refusal);
  std::string out;
  FrameHeader h{options_.opening.protocol, a.type, options_.opening.version, 0, false};
  append_frame(out, h, a.payload, c.session);
  c.decided = true;
  if (a.kind == Answer::Kind::kReply) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.replied;
  }
  c.keep = a.kind == Answer::Kind::kKeep;
  send(c, std::move(out), a.kind == Answer::Kind::kReply);
}

size_t Listener::max_open_per_source() const {
  return options_.max_open_per_source > 0 ? options_.max_open_per_source : std::max<size_t>(1, options_.max_open / 2);
}

bool Listener::reclaim_idle(const std::atomic<size_t>* source) {
  // Oldest idle first; a slot that turned busy meanwhile is passed over.
  std::vector<std::pair<int64_t, std::shared_ptr<Slot>>> idle;
  for (const std::weak_ptr<Slot>& w : slots_) {
    std::shared_ptr<Slot> slot = w.lock();
    if (slot && (source == nullptr || slot->source_open_.get() == source) && slot->reapable_.load() &&
        slot->state_.load() == Slot::kIdle)
      idle.emplace_back(slot->idle_since_ns_.load(), slot);
  }
  std::sort(idle.begin(), idle.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [since, slot] : idle) {
    if (!slot->reclaim()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.reclaimed;
    return true;
  }
  return false;
}

void Slot::idle() {
  // Only this connection's thread turns a busy slot idle, so the time is
  // written before anyone can read it (a slot already idle keeps its time).
  if (state_.load() != kBusy) return;
  idle_since_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
  int busy = kBusy;
  state_.compare_exchange_strong(busy, kIdle);
}

bool Slot::busy() {
  int idle = kIdle;
  return state_.compare_exchange_strong(idle, kBusy) || idle == kBusy;
}

bool Slot::reclaim() {
  int idle = kIdle;
  if (!state_.compare_exchange_strong(idle, kReclaimed)) return false;
  release();
  return true;
}

}  // namespace kvbridge::net

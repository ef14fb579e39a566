// net/listener.h: the one way kvbridge accepts connections, bounded and
// authenticated the same way for every protocol.
//
// A Listener owns a listening socket and one thread. It accepts connections
// and runs the opening exchange (opening.h) on each, non-blocking, with a
// deadline from the accept; only then does the protocol see the connection,
// through two callbacks on the listener thread:
//   on_open(request) decides on the client's Open body: refuse it, reply
//     once and close (the side channel's metadata), or keep the connection;
//   on_keep(accepted) receives a kept connection (socket, session, slot) and
//     must hand it off without blocking (a thread of its own, a poll loop).
// The listening socket defers accepting (TCP_DEFER_ACCEPT, kDeferAccept):
// the kernel hands over a connection once its first bytes have arrived, so
// a client is never judged silent in the moment between its connect() and
// its Open (under a flood that moment lost real clients, try after try). A
// connection that never speaks reaches the listener about a second after its
// connect() and is bounded as below.
// Bounds (every one has a default and is an option):
//   - max_pending connections still in their opening exchange; when a new
//     one arrives and the table is full, the one that got least far (fewest
//     frames received, then no byte received, then the oldest) is closed, and
//     at most half the table is accepted per round, so every connection is
//     read before it can be pushed out: idle connections, however many and
//     however fast, can never lock out a real client, which sends its Open
//     frame at once. One that has sent nothing is not pushed out within
//     idle_grace of its accept by a newer one that has sent nothing either
//     (the newer one is closed at once), so a client slow to write its Open
//     after connect() (a loaded machine) still gets through a flood;
//   - open_timeout from accept to the end of the opening (and of a reply);
//   - max_open kept connections (their slots); past it the listener
//     reclaims the place of the kept connection idle the longest, if its
//     protocol lets it (Slot below), and otherwise refuses the client as
//     busy: connections opened and left idle cannot keep a real client out;
//   - max_open_per_source kept connections from one source
//     (connection_source(): a host, or a user of this host, which a client
//     cannot claim to be another of, secret or not); past it the source's own
//     connection idle the longest makes room, or the client is refused as
//     busy, so one source, whatever names it claims, leaves the rest of
//     max_open to the others. The user this process runs as is not bounded
//     so: its processes are this one's own peers, and could read and write
//     this process's memory anyway (ptrace);
//   - accept errors that mean "out of descriptors or memory" (EMFILE, ENFILE,
//     ENOBUFS, ENOMEM) pause accepting for kAcceptBackoff instead of
//     retrying at once, so the thread never spins;
//   - no thread, buffer or allocation per connection beyond one frame, whose
//     size the protocol's PayloadLimit bounds.
// A client that speaks the frame format before the shared header is answered
// by legacy_reply, if given, so it can say why it cannot talk.
//
// Thread-safety: stats() and address() from any thread; callbacks run on the
// listener thread and must not call back into the Listener. Ownership: the
// Listener closes every connection it still holds when destroyed; a kept
// connection belongs to whoever received it, and its slot counts against
// max_open until that Accepted (its slot) is destroyed.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/status.h"
#include "net/address.h"
#include "net/fd.h"
#include "net/frame.h"
#include "net/opening.h"
#include "net/session.h"

namespace kvbridge::net {

inline constexpr std::chrono::milliseconds kAcceptBackoff{100};
// TCP_DEFER_ACCEPT: how long the kernel holds a connection that has sent
// nothing before handing it to accept() anyway.
inline constexpr std::chrono::seconds kDeferAccept{1};

struct OpenRequest {
  std::string peer_address;    // "127.0.0.1:40312"
  std::string_view body;       // the client's Open body
  bool authenticated = false;  // the client proved the shared secret
};

struct Answer {
  enum class Kind { kRefuse, kReply, kKeep } kind = Kind::kRefuse;
  Refusal refusal;   // kRefuse
  uint8_t type = 0;  // kReply, kKeep: the first protocol frame (>= 16)
  std::string payload;
  static Answer refuse(RefuseCode code, std::string message, std::string detail = {}) {
    Answer a;
    a.refusal = Refusal{code, std::move(message), std::move(detail)};
    return a;
  }
  static Answer reply(uint8_t type, std::string payload) { return Answer{Kind::kReply, {}, type, std::move(payload)}; }
  static Answer keep(uint8_t type, std::string payload) { return Answer{Kind::kKeep, {}, type, std::move(payload)}; }
};

// A kept connection's place against max_open (Accepted::slot); the place is
// free when the last copy of the slot is destroyed, or when the listener
// reclaims it. A protocol whose kept connections wait idle between requests
// lets the listener reclaim them: it calls set_reapable() in on_keep, idle()
// before each wait for the next request, busy() once one arrives, and looks
// at reclaimed() at least once a second while it waits. When every place is
// taken and a new client is to be kept, the listener reclaims the place idle
// the longest: the slot turns from idle to reclaimed and the place counts as
// free at once. The protocol then closes that connection without serving
// another request: it sends its end (shutdown SHUT_WR), reads and drops what
// the client still sends, and closes once the client closes, so the client
// sees an orderly close, never a reset, and knows nothing of a request it
// sent on the stream was served. A connection serving a request is never
// reclaimed.
//
// Thread-safety: idle(), busy() and reclaimed() from the connection's
// serving thread; set_reapable() before the first idle().
class Slot {
 public:
  // Counts against `open` (and `source_open`, its source's count, when given).
  explicit Slot(std::shared_ptr<std::atomic<size_t>> open, std::shared_ptr<std::atomic<size_t>> source_open = nullptr)
      : open_(std::move(open)), source_open_(std::move(source_open)) {
    open_->fetch_add(1);
    if (source_open_) source_open_->fetch_add(1);
  }
  ~Slot() { release(); }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

  void set_reapable() { reapable_.store(true); }
  // Between requests; the time it turned idle is the one reclaiming goes by.
  void idle();
  // false when the listener reclaimed the place: close, serving nothing more.
  bool busy();
  bool reclaimed() const { return state_.load() == kReclaimed; }

 private:
  friend class Listener;
  enum State : int { kBusy, kIdle, kReclaimed };
  bool reclaim();  // idle -> reclaimed, and the place freed
  void release() {
    if (released_.exchange(true)) return;
    open_->fetch_sub(1);
    if (source_open_) source_open_->fetch_sub(1);
  }
  std::shared_ptr<std::atomic<size_t>> open_;
  std::shared_ptr<std::atomic<size_t>> source_open_;
  std::atomic<bool> reapable_{false};
  std::atomic<int> state_{kBusy};
  std::atomic<int64_t> idle_since_ns_{0};
  std::atomic<bool> released_{false};
};

struct Accepted {
  Fd fd;            // non-blocking
  Session session;  // keyed when the client proved the secret
  std::string peer_address;
  std::string body;
  std::shared_ptr<Slot> slot;  // counts against max_open while it lives
};

struct ListenerOptions {
  std::string name;                        // "side channel", "control listener": errors and stats
  std::string thread_name = "kvb-listen";  // its thread's name (15 bytes at most)
  HostPort bind;
  OpeningConfig opening;
  PayloadLimit limit;  // the protocol's limits; must cover the opening types
  size_t max_pending = 64;
  size_t max_open = 256;
  size_t max_open_per_source = 0;  // 0: half of max_open
  std::chrono::milliseconds open_timeout{3000};
  // Time a connection that has sent nothing is kept against newer silent
  // ones (at most half of open_timeout).
  std::chrono::milliseconds idle_grace{500};
  int backlog = 1024;
  std::function<Answer(const OpenRequest&)> on_open;
  std::function<void(Accepted)> on_keep;                        // required for Answer::kKeep
  std::function<std::string(Protocol, uint16_t)> legacy_reply;  // optional
};

struct ListenerStats {
  uint64_t accepted = 0;
  uint64_t replied = 0;    // kReply answers sent whole
  uint64_t kept = 0;       // connections handed to on_keep
  uint64_t refused = 0;    // Refuse frames sent (on_open's, auth, version, malformed, busy)
  uint64_t abandoned = 0;  // closed without an answer: deadline, client gone, evicted, errors
  uint64_t evicted = 0;    // of those, closed for a newer connection, or a new silent one closed at once (max_pending)
  uint64_t accept_pauses = 0;  // times accepting paused for kAcceptBackoff
  uint64_t reclaimed = 0;      // idle kept connections closed to keep a new client
  size_t pending = 0;
  size_t open = 0;
  uint64_t refused_source = 0;  // of the refusals, busy because the client's source held its share
  std::string last_failure;     // "client 127.0.0.1:40312: <why>" for the last refusal or abandon
};

class Listener {
 public:
  // Binds and starts the thread. kInvalidArgument for missing callbacks or
  // zero bounds; kUnavailable when the address cannot be bound.
  static Result<std::unique_ptr<Listener>> start(ListenerOptions options);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  const HostPort& address() const { return address_; }
  ListenerStats stats() const;

 private:
  struct Conn;
  explicit Listener(ListenerOptions options);
  void loop();
  void accept_all();
  void step(Conn& c, short revents);
  void on_frame(Conn& c);
  void answer(Conn& c);
  void send(Conn& c, std::string bytes, bool final);
  void refuse(Conn& c, const Refusal& refusal);
  void abandon(Conn& c, const std::string& why);
  void note_failure(const Conn& c, const std::string& why);
  // Reclaims the place of the kept connection idle the longest (of the
  // source counted by `source`, when given); false when no such kept
  // connection is idle and reapable.
  bool reclaim_idle(const std::atomic<size_t>* source = nullptr);
  size_t max_open_per_source() const;

  const ListenerOptions options_;
  HostPort address_;
  Fd listen_fd_;
  Fd wake_fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::shared_ptr<std::atomic<size_t>> open_ = std::make_shared<std::atomic<size_t>>(0);
  std::chrono::steady_clock::time_point paused_until_{};
  mutable std::mutex mu_;  // guards stats_
  ListenerStats stats_;
  std::vector<std::unique_ptr<Conn>> conns_;  // the listener thread's only
  std::vector<std::weak_ptr<Slot>> slots_;    // kept connections' places; the listener thread's only
  // Kept connections per source (connection_source()); the listener thread's only.
  std::map<std::string, std::shared_ptr<std::atomic<size_t>>> sources_;
  std::string own_source_;  // connection_source() of this process's own user
};

}  // namespace kvbridge::net

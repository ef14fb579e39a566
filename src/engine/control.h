// engine/control.h: the engine's control connections.
//
// Each engine listens on a small control port (its address is in the
// metadata; a net::Listener, so every connection opens with the shared
// exchange, with the engine's secret when it has one) and opens one outbound
// Channel per connected peer. Channels carry notifications, which the
// engine sends only after every Link::run of a transfer returned OK, so a
// notification never overtakes the bytes; the receiver acknowledges each
// one, and a notification is done only when its acknowledgement came back.
// Nothing waits for an acknowledgement on a thread: a notification's `done`
// callback runs when it arrives, when its deadline passes, or when the
// channel ends, so a stopped or slow peer delays only its own notifications.
// Channels also tell the engine when a peer is gone: the kernel closes a dead
// process's sockets, and the control thread sees the end of stream at once.
//
// Protocol (version 3, docs/formats/control.md): the client's Open body is
// its identity (engine name, instance, pid) and the instance it expects to
// reach; the server refuses another instance (stale metadata) and more than
// kMaxInboundPerPeer connections from one identity; Accept carries the
// server's instance. Then Notify {seq, message} and Ack {seq, answer}, tagged
// when the secret was proven: the answer (at most kMaxNotificationAnswerBytes,
// often empty) is what the receiving engine's answerer said of the
// notification when it arrived. A frame that breaks the protocol closes the
// connection. Nothing in a frame is trusted beyond these checks; a
// notification names the identity its connection opened with, which only a
// secret makes proven (docs/security.md).
//
// Thread-safety: every method may be called from any thread. One control
// thread per engine (plus the listener's) polls inbound connections and
// every channel; callbacks run on it and must not call back into Control.
// Ownership: Control owns the listener and inbound connections; a Channel is
// shared by the engine and the control thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/status.h"
#include "net/fd.h"
#include "net/frame.h"
#include "net/listener.h"
#include "net/session.h"

namespace kvbridge::engine_internal {

using Clock = std::chrono::steady_clock;

inline constexpr uint16_t kControlVersion = 3;
inline constexpr size_t kMaxControlPayload = size_t{1} << 20;  // also the notification bound
inline constexpr size_t kMaxInboundPerPeer = 16;
inline constexpr size_t kMaxInbound = 1024;
// Bytes a channel may hold for a peer that is not reading before new
// notifications fail at once.
inline constexpr size_t kMaxQueuedBytes = size_t{4} << 20;

// Who is on the other end of a control connection.
struct ControlIdentity {
  std::string name;
  uint64_t instance = 0;
  uint64_t pid = 0;
};

struct ControlOptions {
  std::string host = "127.0.0.1";  // bind host (port chosen by the kernel)
  std::string advertise_host;      // the host in address(); empty: `host`
  std::string secret;
  ControlIdentity self;
  std::chrono::milliseconds open_timeout{5000};
};

class Control;

// The control protocol's payload limits (for its FrameReaders).
size_t control_payload_limit(uint8_t type);

// One outbound control connection to a peer.
class Channel {
 public:
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Queues `message`; `done` runs exactly once: OK when the peer
  // acknowledged it, kTimeout past `deadline`, kIoError naming the peer when
  // the connection ended, kResourceExhausted when the peer is not reading
  // (kMaxQueuedBytes queued). It runs on the control thread, or on this one
  // when the channel is already gone; it must not block. Notifications are
  // sent in call order. `drop` (fault injection) sends nothing, so `done`
  // sees the deadline, as for a message lost on the way.
  void notify(std::string message, Clock::time_point deadline, std::function<void(Status)> done, bool drop = false);
  // The same, with the peer's answer (empty unless OK).
  void notify(std::string message, Clock::time_point deadline, std::function<void(Status, std::string)> answered,
              bool drop = false);
  // The same, waiting for `done`.
  Status notify_and_wait(std::string message, Clock::time_point deadline, bool drop = false);
  // Whether the connection is still open; why not.
  Status health() const;
  const std::string& peer() const { return peer_; }

 private:
  friend class Control;
  using Done = std::function<void(Status, std::string)>;
  struct Pending {
    Clock::time_point deadline;
    Done done;
  };
  Channel(Control* control, net::Fd fd, net::Session session, std::string peer,
          std::function<void(const Status&)> on_gone)
      : control_(control),
        fd_(std::move(fd)),
        session_(std::move(session)),
        peer_(std::move(peer)),
        on_gone_(std::move(on_gone)) {}
  // Under mu_: records the end once; returns the callbacks to run (outside).
  std::vector<Done> end_locked(const Status& why);

  Control* const control_;
  net::Fd fd_;
  net::Session session_;  // its tag() runs on callers under mu_, check() on the control thread
  const std::string peer_;
  const std::function<void(const Status&)> on_gone_;
  mutable std::mutex mu_;
  uint64_t next_seq_ = 0;
  std::string out_;  // frames not yet written
  size_t out_pos_ = 0;
  std::map<uint64_t, Pending> pending_;  // by seq, awaiting their Ack
  Status gone_;                          // OK while open
  bool gone_reported_ = false;
  // Control thread only: the Acks being read.
  net::FrameReader reader_{net::Protocol::kControl, kControlVersion, control_payload_limit};
};

class Control {
 public:
  // Starts the listener and the control thread. `on_notification` runs on
  // the control thread for each Notify received; what it returns (at most
  // kMaxNotificationAnswerBytes: longer is cut) travels back in the Ack.
  static Result<std::unique_ptr<Control>> create(ControlOptions options,
                                                 std::function<std::string(Notification)> on_notification);
  // Closes every connection (pending notifications fail), joins.
  ~Control();

  // "host:port" of the listener.
  std::string address() const;

  // Connects to a peer's control address, runs the opening exchange (within
  // options.open_timeout) naming `instance` as the engine it expects, and
  // returns the channel. `peer` names the peer in errors ("'b' (instance
  // ..., pid ...)"). `on_gone` runs once if the connection ends while open
  // (not on close()), on the control thread. kUnavailable / kIoError /
  // kTimeout naming the peer; the opening's errors (kPermissionDenied for a
  // secret mismatch, kUnavailable for another instance) as they are.
  Result<std::shared_ptr<Channel>> connect(const std::string& address, uint64_t instance, const std::string& peer,
                                           std::function<void(const Status&)> on_gone);
  // Stops polling `channel` and marks it closed (pending notifications
  // fail); on_gone does not fire.
  void close(const std::shared_ptr<Channel>& channel);

 private:
  friend class Channel;
  struct Inbound;
  Control() = default;
  net::Answer answer(const net::OpenRequest& request);
  void adopt(net::Accepted accepted);
  void loop();
  void wake();
  bool read_inbound(Inbound& in);   // false: close it
  bool read_channel(Channel& ch);   // false: the connection ended
  bool write_channel(Channel& ch);  // false: the connection ended
  void expire(Channel& ch, Clock::time_point now);
  void end_channel(Channel& ch, const Status& why, bool report);

  ControlOptions options_;
  std::function<std::string(Notification)> on_notification_;
  net::Fd wake_fd_;
  std::thread thread_;
  std::mutex mu_;  // guards channels_, adopted_, per_peer_ and stop_
  bool stop_ = false;
  std::vector<std::shared_ptr<Channel>> channels_;
  std::vector<net::Accepted> adopted_;                           // kept by the listener, not yet polled
  std::map<std::pair<std::string, uint64_t>, size_t> per_peer_;  // inbound connections per identity
  std::vector<std::unique_ptr<Inbound>> inbound_;                // control thread only
  std::unique_ptr<net::Listener> listener_;                      // last: stopped first
};

}  // namespace kvbridge::engine_internal

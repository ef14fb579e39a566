// engine/control.h: the engine's control connections.
//
// Each engine listens on a small TCP control port (its address is in the
// metadata) and opens one outbound Channel per connected peer. Channels carry
// notifications, which the engine sends only after every Link::run of a
// transfer returned OK, so a notification never overtakes the bytes; the
// receiver acknowledges each one and the sender waits for the acknowledgement,
// so a transfer with a notification is done only when the peer has it.
// Channels also tell the engine when a peer is gone: the kernel closes a dead
// process's sockets, and the control thread sees the end of stream at once,
// even while no notification is pending.
//
// Wire format: every frame is a 20-byte header (u32 magic "KVBC", u16 version
// 1, u16 type, u64 sequence, u32 payload length, little-endian) and the
// payload. HELLO (the sender's engine name) opens a connection, NOTIFY carries
// a message, ACK echoes a NOTIFY's sequence. Payloads are bounded
// (kMaxControlPayload); a frame with a bad magic, version, type or length
// closes the connection. Nothing in a frame is trusted beyond these checks.
//
// Thread-safety: every method may be called from any thread. One control
// thread per engine polls the listener and every connection; callbacks run
// on it and must not call back into Control. Ownership: Control owns the
// listener and inbound connections; a Channel owns its socket and is shared
// by the engine and the control thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/status.h"

namespace kvbridge::engine_internal {

using Clock = std::chrono::steady_clock;

inline constexpr uint32_t kControlMagic = 0x4342564b;  // "KVBC" little-endian
inline constexpr uint16_t kControlVersion = 1;
inline constexpr size_t kControlHeaderBytes = 20;
inline constexpr size_t kMaxControlPayload = size_t{1} << 20;  // also the notification bound

class Control;

// One outbound control connection to a peer.
class Channel {
 public:
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Sends `message` and waits for the peer's acknowledgement. Notifications
  // on one channel are sent and acknowledged in call order. kIoError naming
  // the peer when the connection is gone, kTimeout past `deadline`.
  // `drop` (fault injection) sends nothing but still waits, as a message lost
  // on the way would.
  Status notify(std::string_view message, Clock::time_point deadline, bool drop = false);
  // Whether the connection is still open; why not.
  Status health() const;
  const std::string& peer() const { return peer_; }

 private:
  friend class Control;
  Channel(int fd, std::string peer, std::function<void(const Status&)> on_gone)
      : fd_(fd), peer_(std::move(peer)), on_gone_(std::move(on_gone)) {}
  // Called by the control thread: records the end and wakes waiters. Returns
  // whether this call ended it (so on_gone fires once).
  bool end(Status why);

  const int fd_;
  const std::string peer_;
  const std::function<void(const Status&)> on_gone_;
  std::mutex send_mu_;  // serializes frames on the socket
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_seq_ = 0;   // guarded by send_mu_
  uint64_t acked_seq_ = 0;  // guarded by mu_
  Status gone_;             // guarded by mu_; OK while open
  std::string in_;          // control thread only: unparsed bytes
};

class Control {
 public:
  // Listens on `host` (port chosen by the kernel) and starts the control
  // thread. `on_notification` runs on that thread for each NOTIFY received.
  static Result<std::unique_ptr<Control>> create(const std::string& host, std::string self_name,
                                                 std::function<void(Notification)> on_notification);
  // Closes every connection (channels report kIoError to waiters), joins.
  ~Control();

  // "host:port" of the listener.
  const std::string& address() const { return address_; }

  // Connects to a peer's control address and says hello. `peer` names the
  // peer in errors, as given ("'b' (instance ..., pid ...)"). `on_gone` runs once
  // if the connection ends while open (not on close): on the control thread,
  // or on the thread whose notify() found the connection broken.
  Result<std::shared_ptr<Channel>> connect(const std::string& address, const std::string& peer,
                                           std::function<void(const Status&)> on_gone,
                                           Clock::time_point deadline);
  // Stops polling `channel` and marks it closed; on_gone does not fire.
  void close(const std::shared_ptr<Channel>& channel);

 private:
  struct Inbound;
  Control() = default;
  void loop();
  void wake();
  void accept_all();
  bool read_inbound(Inbound& in);   // false: close it
  bool read_channel(Channel& ch);   // false: the connection ended

  std::string self_name_;
  std::function<void(Notification)> on_notification_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::string address_;
  std::thread thread_;
  std::mutex mu_;  // guards channels_ and stop_
  bool stop_ = false;
  std::vector<std::shared_ptr<Channel>> channels_;
  std::vector<std::unique_ptr<Inbound>> inbound_;  // control thread only
};

// Writes one frame to a blocking-or-not socket, polling until `deadline`.
Status write_frame(int fd, uint16_t type, uint64_t seq, std::string_view payload, Clock::time_point deadline,
                   std::string_view peer);

}  // namespace kvbridge::engine_internal

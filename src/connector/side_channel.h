// connector/side_channel.h: the side channel through which a decode rank
// fetches a prefill rank's metadata.
//
// Each prefill rank runs a SideChannelServer: one thread that accepts TCP
// connections and answers each with the two-phase handshake of handshake.h
// (version, optional mutual shared-secret proof, compatibility hash; then the
// RankInfo). A decode rank calls fetch_rank_info() once per peer rank. Both
// sides bound every wait by SideChannelOptions::timeout and every size by the
// limits in handshake.h; the wire format and the state machine are in
// docs/formats/handshake.md.
//
// The shared secret authenticates the two ends to each other (HMAC-SHA256
// over fresh nonces); it does not encrypt the channel or bind it to the TCP
// connection, so a relay in the middle can still pass the exchange along.
// Anyone who connects learns HMAC(secret, nonces) and may guess a weak secret
// offline: use a random one of 16 bytes or more.
//
// Thread-safety: SideChannelServer's methods may be called from any thread;
// fetch_rank_info() is reentrant.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "connector/handshake.h"
#include "kvbridge/status.h"

namespace kvbridge::connector {

struct SideChannelOptions {
  std::string host = "127.0.0.1";  // bind address (server)
  uint16_t port = 0;               // 0 = ephemeral (server)
  std::string secret;              // empty: no authentication; else both sides must share it
  std::chrono::milliseconds timeout{5000};  // per handshake, both sides
  // Fault injection for tests and `kvbridge demo --inject` (server side only):
  uint16_t advertise_version = kHandshakeVersion;  // pretend to speak another version
  // kGarbage: random bytes instead of the server's first frame, then close.
  // kTruncate: the first half of the Metadata frame, then close.
  enum class ReplyFault : uint8_t { kNone, kGarbage, kTruncate } reply_fault = ReplyFault::kNone;
};

// The server side. It handles up to kMaxConnections handshakes at once, each
// bounded by options.timeout from its accept; further clients wait in the
// listen backlog. A client that sends garbage, stops mid-frame, stays silent
// or goes away costs one slot until its deadline and is counted in
// rejected(); the server keeps serving.
class SideChannelServer {
 public:
  static constexpr size_t kMaxConnections = 8;

  // Binds options.host:options.port and starts the thread. `identity` is
  // identity_text(layout) (sent, bounded to kMaxIdentityBytes, only to an
  // authenticated client whose hash differs), `hash` compatibility_hash(layout).
  // Returns kInvalidArgument when `info` fails check_rank_info(), the identity
  // is too long, or options.timeout is not positive; kUnavailable when the
  // address cannot be bound; kIoError when a thread resource fails.
  static Result<std::unique_ptr<SideChannelServer>> start(const SideChannelOptions& options, std::string identity,
                                                          uint64_t hash, RankInfo info);
  // Stops the thread and closes every connection, mid-handshake or not.
  ~SideChannelServer();
  SideChannelServer(const SideChannelServer&) = delete;
  SideChannelServer& operator=(const SideChannelServer&) = delete;

  // "host:port" ("[v6]:port"), with the bound port.
  std::string address() const;
  // Replaces what later handshakes serve (e.g. after new registrations). An
  // info that fails check_rank_info() makes later handshakes end in a Reject
  // (code unavailable) naming the field.
  void set_info(RankInfo info);
  // Handshakes that ended in a Metadata frame. Counted when the server
  // decides to send it, so a client that has its reply sees the count.
  uint64_t served() const { return served_.load(); }
  // Handshakes refused or abandoned (version, hash, authentication, malformed
  // frames, deadline, client gone, injected faults). Counted like served().
  uint64_t rejected() const { return rejected_.load(); }
  // "client 127.0.0.1:40312: <why>" for the last of those; empty if none.
  std::string last_rejection() const;

 private:
  struct Connection;
  SideChannelServer() = default;
  void loop();
  void accept_all();
  void step(Connection& c, short revents);
  void on_frame(Connection& c);
  void after_auth(Connection& c);
  void send_final(Connection& c, std::string frame, bool metadata);
  void reject(Connection& c, RejectCode code, const std::string& why, uint64_t hash = 0, std::string identity = {});
  void abandon(Connection& c, const std::string& why);
  void record_rejection(const Connection& c, const std::string& why);

  SideChannelOptions options_;
  std::string identity_;
  uint64_t hash_ = 0;
  std::string address_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> rejected_{0};
  mutable std::mutex mu_;  // guards info_ and last_rejection_
  RankInfo info_;
  std::string last_rejection_;
  std::vector<std::unique_ptr<Connection>> connections_;  // the server thread's only
};

// The client side: connects to `address` ("host:port" or "[v6]:port"), runs
// the handshake within options.timeout (connect included), and returns the
// peer's RankInfo. `local_identity` and `local_hash` are this rank's
// identity_text() and compatibility_hash(); options.secret is this side's
// secret (a non-empty one makes the peer prove it too). Every error message
// starts with "side channel <address>: " and names the cause:
//   kIncompatible: "handshake version mismatch: local 1, peer 2";
//     "compatibility hash mismatch (local 691f..., peer 12ab...): <the first
//     differing field, from compare_identity_text()>";
//   kPermissionDenied: "authentication failed: peer requires a shared
//     secret" / "...: wrong shared secret" / "...: this side has a shared
//     secret but the peer has none";
//   kInvalidArgument: "malformed handshake: <the decoder's words>", e.g.
//     "Metadata frame length 4294967295 exceeds 25165824", "truncated Metadata
//     frame: peer closed after 100 of 200 payload bytes";
//   kTimeout: the deadline passed (the message says in which step);
//   kUnavailable: the address cannot be resolved or the connection is refused;
//   kIoError: the connection failed or closed before the first reply byte.
Result<RankInfo> fetch_rank_info(std::string_view address, std::string_view local_identity, uint64_t local_hash,
                                 const SideChannelOptions& options);

}  // namespace kvbridge::connector

// connector/side_channel.h: the side channel through which a decode rank
// fetches a prefill rank's metadata.
//
// Each rank runs a SideChannelServer on a net::Listener (net/listener.h):
// every connection opens with the shared exchange (version, the optional
// shared secret), its Open body is the client's compatibility hash, and the
// server answers once (handshake.h) and closes. A decode rank calls
// fetch_rank_info() once per peer rank. The listener bounds connections still
// opening (the oldest gives way to a new one, so idle clients cannot block a
// real handshake), the time from accept to the answer (options.timeout), and
// every frame's size; the wire format is docs/formats/handshake.md.
//
// The shared secret authenticates both ends (HMAC-SHA256 proofs over fresh
// nonces and the whole Open frame, net/opening.h) and tags the Metadata
// frame; it does not encrypt it. Anyone who connects learns an HMAC over
// nonces and may guess a weak secret offline: use a random one of 16 bytes
// or more (docs/security.md).
//
// Thread-safety: SideChannelServer's methods may be called from any thread;
// fetch_rank_info() is reentrant.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "connector/handshake.h"
#include "kvbridge/status.h"
#include "net/listener.h"

namespace kvbridge::connector {

struct SideChannelOptions {
  std::string host = "127.0.0.1";           // bind address (server)
  std::string advertise_host;               // the host in address(); empty: `host` (server)
  uint16_t port = 0;                        // 0 = ephemeral (server)
  std::string secret;                       // empty: no authentication; else both sides must share it
  std::chrono::milliseconds timeout{5000};  // per handshake, both sides
  size_t max_pending = 64;                  // server: connections still opening
};

class SideChannelServer {
 public:
  // Binds options.host:options.port and starts the listener. `identity` is
  // identity_text(layout) (sent, bounded to kMaxIdentityBytes, only to a
  // client that passed the opening exchange and whose hash differs), `hash`
  // compatibility_hash(layout). kInvalidArgument when `info` fails
  // check_rank_info(), the identity is too long, the host is malformed or
  // options.timeout is not positive; kUnavailable when the address cannot be
  // bound.
  static Result<std::unique_ptr<SideChannelServer>> start(const SideChannelOptions& options, std::string identity,
                                                          uint64_t hash, RankInfo info);
  ~SideChannelServer();

  // "host:port" ("[v6]:port"), with the bound port.
  std::string address() const;
  // Replaces what later handshakes serve. An info that fails
  // check_rank_info() makes later handshakes end in a Refuse (unavailable).
  void set_info(RankInfo info);
  // Handshakes that ended in a Metadata frame (counted when the server
  // decides to send it, so a client that has its reply sees the count).
  uint64_t served() const;
  // Handshakes refused or abandoned (version, hash, authentication, malformed
  // frames, deadline, client gone, closed for a newer connection).
  uint64_t rejected() const;
  // "client 127.0.0.1:40312: <why>" for the last of those; empty if none.
  std::string last_rejection() const;

 private:
  SideChannelServer() = default;
  net::Answer answer(const net::OpenRequest& request);

  std::string identity_;
  uint64_t hash_ = 0;
  std::string advertise_host_;  // the host in address(), when not the bound one
  mutable std::mutex mu_;       // guards info_
  RankInfo info_;
  std::unique_ptr<net::Listener> listener_;  // last: stopped first
};

// A Refuse in the format of handshake version 1 (the frame header before the
// shared one), so that a version 1 client says "handshake version mismatch:
// local 1, peer 2" instead of failing on bytes it cannot read.
std::string legacy_version_refusal(uint16_t their_version);

// The client side: connects to `address` ("host:port" or "[v6]:port"), runs
// the handshake within options.timeout (connect included), and returns the
// peer's RankInfo. `local_identity` and `local_hash` are this rank's
// identity_text() and compatibility_hash(); options.secret is this side's
// secret (a non-empty one makes the peer prove it too). Every error message
// starts with "side channel <address>: " and names the cause:
//   kIncompatible: "side channel version mismatch: local 2, peer 3";
//     "compatibility hash mismatch (local 691f..., peer 12ab...): <the first
//     differing field, from compare_identity_text()>";
//   kPermissionDenied: "authentication failed: peer requires a shared
//     secret" / "...: wrong shared secret" / "...: this side has a shared
//     secret but the peer has none";
//   kInvalidArgument: "malformed handshake: <the decoder's words>", e.g. a
//     Metadata frame cut short, or a malformed address;
//   kTimeout: the deadline passed (the message says in which step);
//   kUnavailable: the address cannot be resolved, the connection is refused,
//     or the server is busy;
//   kIoError: the connection failed or closed before the answer.
Result<RankInfo> fetch_rank_info(std::string_view address, std::string_view local_identity, uint64_t local_hash,
                                 const SideChannelOptions& options);

}  // namespace kvbridge::connector

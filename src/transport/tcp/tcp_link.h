// transport/tcp_link.h: the client half of the tcp transport, a Link to one
// peer over several TCP streams.
//
// Each stream opens with the shared exchange (net/opening.h) naming the
// server transport instance from the address blob, with the engine's secret
// when it has one; then every frame on it is tagged.
//
// A run spreads its copies over up to `streams` streams by bytes (small runs
// use one), each driven by its own thread (the caller's for the first) as a
// non-blocking state machine that pipelines request frames and receives
// replies straight into local memory (reads) or sends straight from it
// (writes, complete when every WRITE_ACK arrived).
//
// Runs execute on the link's own threads (Link::runs_async: up to `streams`
// of them, started as runs need them), never on the engine's: a peer that
// stops answering stalls only its own link's runs, until their deadlines.
//
// Streams are pooled: concurrent runs take idle streams, or wait for one
// within their deadline. A stream whose run ended other than OK (deadline,
// error, a peer's ERROR frame) is closed, so no byte of that run can land
// locally later and the next run dials a fresh one: a stream is always
// either idle between frames or closed, never in between. A write stopped by
// cancel drains instead: it finishes the frame it is sending and waits (up
// to 200 ms) for the acknowledgement of every frame sent, so that nothing of
// it lands at the peer after run() returns (the peer's server writes bytes as
// they arrive); past that, the stream is closed and the error says that sent
// frames may still land.
//
// Thread-safety: run() may be called concurrently.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/address.h"
#include "net/fd.h"
#include "net/session.h"
#include "net/socket.h"
#include "transport/copies.h"
#include "transport/transport.h"

namespace kvbridge::transport::tcp {

struct TcpPeer {
  std::string name;  // the peer engine's name, for messages
  net::HostPort address;
  uint64_t instance = 0;  // from the address blob, checked by the opening
  std::string local_label;
  std::string secret;
};

// The address blob: "host:port/instance" (instance in hex).
std::string format_address(const net::HostPort& hp, uint64_t instance);
Result<TcpPeer> parse_address(std::string_view blob, std::string peer_name);

class TcpLink : public Link {
 public:
  // Dials one stream (and says hello) within `connect_timeout` to check that
  // the peer is there. kIoError / kUnavailable naming the peer otherwise.
  static Result<std::unique_ptr<TcpLink>> create(TcpPeer peer, uint32_t streams,
                                                 std::chrono::milliseconds connect_timeout);
  ~TcpLink() override;

  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override;
  bool runs_async() const override { return true; }
  void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done) override;
  // The server checks ranges against its own registrations, so nothing to do.
  Status refresh(const PeerInfo& peer) override;
  // The peer's server hashes the ranges itself (Digest frames): no byte
  // crosses the network again.
  Status digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes) override;

 private:
  struct Stream {
    net::Fd fd;
    net::Session session;
  };

  TcpLink(TcpPeer peer, uint32_t streams);
  Status open(Stream& stream, const net::IoLimits& limits);
  void close(Stream& stream);
  // Takes between 1 and `wanted` idle streams, waiting within `limits`.
  Result<std::vector<Stream*>> acquire(size_t wanted, const net::IoLimits& limits);
  void release(const std::vector<Stream*>& streams);
  // Sends the pieces on `stream`, opening it first when it is closed, or
  // was closed by the peer while pooled. A pooled stream the peer closed in
  // order before any reply (its server reclaimed the idle stream for another
  // client and served nothing of the run, net::Slot) is opened again and the
  // run sent once more.
  Status run_stream(Stream& stream, TransferOp op, std::span<const Copy> copies, RunControl& control,
                    const std::atomic<bool>& abort);
  // One attempt on an open stream; `answered`: a reply byte arrived.
  Status run_frames(Stream& stream, TransferOp op, std::span<const Copy> copies, RunControl& control,
                    const std::atomic<bool>& abort, bool* answered);

  // One Digest frame and its answer on an open stream.
  Status digest_frame(Stream& stream, std::span<const Copy> copies, const net::IoLimits& limits,
                      std::vector<uint64_t>* hashes, bool* answered);

  TcpPeer peer_;
  std::string who_;  // "tcp peer 'name' (host:port)"
  std::vector<std::unique_ptr<Stream>> all_;
  std::mutex mutex_;
  std::condition_variable idle_cv_;
  std::vector<Stream*> idle_;
  // Threads for start(): up to `streams` runs at once.
  std::unique_ptr<RunThreads> runners_;
};

}  // namespace kvbridge::transport::tcp

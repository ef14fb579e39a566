// transport/tcp_server.h: the serving half of the tcp transport.
//
// A TcpServer listens on host:port, accepts streams from peers' links, and
// serves their READ and WRITE frames against this engine's registered
// segments. It trusts nothing a peer sends: every frame is decoded by
// tcp_protocol's checked decoders and every range must lie inside one
// registered segment, or the peer gets an ERROR frame and nothing is touched.
//
// Memory safety against deregistration: the server touches segment memory
// only inside non-blocking syscalls made under a shared lock, after checking
// that no segment was removed since the frame was validated (an epoch
// counter). remove_segment() takes the lock exclusively, so when it returns
// the server never touches that segment again; a frame that was using it is
// abandoned and its stream closed.
//
// Thread-safety: add/remove_segment from any thread; one thread accepts and
// one thread serves each stream. The destructor stops and joins them all.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>

#include "kvbridge/status.h"
#include "transport/tcp_protocol.h"

namespace kvbridge::transport::tcp {

class TcpServer {
 public:
  // Binds host:port (port 0: ephemeral) and starts accepting. kUnavailable
  // when it cannot listen.
  static Result<std::unique_ptr<TcpServer>> create(const std::string& host, uint16_t port, std::string label);
  ~TcpServer();

  uint16_t port() const { return port_; }
  uint64_t instance() const { return instance_; }

  void add_segment(uint32_t id, uint64_t base, uint64_t bytes);
  // When it returns, no stream touches [base, base + bytes) of `id` again.
  void remove_segment(uint32_t id);

 private:
  struct Conn {
    int fd = -1;  // guarded by conns_mutex_; closed by its thread
    std::thread thread;
    std::atomic<bool> finished{false};
  };

  TcpServer(int listen_fd, uint16_t port, std::string label);
  void accept_loop();
  void serve(Conn* conn, int fd);
  Status serve_frames(int fd, std::string& peer_label);
  Status serve_request(int fd, const FrameHeader& header, const std::string& peer);
  // Moves `total` bytes between the socket and the validated `ranges`,
  // re-validating them whenever a segment was removed meanwhile.
  Status move_data(int fd, bool to_socket, const std::vector<Range>& ranges, const std::string& prefix,
                   const std::string& peer);
  Status drain(int fd, uint64_t bytes, const std::string& peer);
  std::optional<SegmentSpan> lookup_locked(uint32_t id) const;
  void close_conn(Conn* conn);
  void reap_finished();

  int listen_fd_;
  int wake_fds_[2] = {-1, -1};  // a pipe that wakes accept_loop on shutdown
  uint16_t port_;
  uint64_t instance_;
  std::string label_;
  std::atomic<bool> stop_{false};

  mutable std::shared_mutex segments_mutex_;
  std::map<uint32_t, SegmentSpan> segments_;
  std::atomic<uint64_t> epoch_{0};  // bumped by every remove_segment

  std::mutex conns_mutex_;
  std::list<std::unique_ptr<Conn>> conns_;
  std::thread accept_thread_;
};

}  // namespace kvbridge::transport::tcp

// transport/tcp_server.h: the serving half of the tcp transport.
//
// A TcpServer accepts streams from peers' links on a net::Listener (so each
// opens with the shared exchange: the engine's secret when it has one, the
// listener's bounds on connections still opening) and serves their Read and
// Write frames against this engine's registered segments. It trusts nothing a
// peer sends: every frame is decoded by tcp_protocol's checked decoders,
// every range must lie inside one registered segment that grants the access
// the request needs, or the peer gets an Error frame and nothing is touched.
// Each accepted stream is served by a thread of its own, at most
// kMaxStreams of them (and kMaxStreamsPerPeer per client label). When all
// are taken, a new client gets the place of the stream idle the longest (the
// listener reclaims it, net::Slot; its client's link opens another stream
// when it next needs one); with none idle it is refused as busy. A thread
// that cannot start closes its stream instead of taking the process down.
//
// Memory safety against deregistration: the server touches segment memory
// only inside non-blocking syscalls made under a shared lock, after checking
// that no segment was removed since the frame was validated (an epoch
// counter). remove_segment() takes the lock exclusively, so when it returns
// the server never touches that segment again; a frame that was using it is
// abandoned and its stream closed.
//
// Thread-safety: add/remove_segment from any thread. The destructor stops
// and joins every thread.
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
#include <tuple>
#include <vector>

#include "kvbridge/status.h"
#include "net/listener.h"
#include "transport/staging.h"
#include "transport/tcp/tcp_protocol.h"
#include "transport/transport.h"

namespace kvbridge::transport::tcp {

inline constexpr size_t kMaxStreams = 256;
inline constexpr size_t kMaxStreamsPerPeer = 128;

class TcpServer {
 public:
  // Binds `at` (port 0: ephemeral) and starts accepting. kUnavailable when
  // it cannot listen.
  static Result<std::unique_ptr<TcpServer>> create(const net::HostPort& at, std::string label, std::string secret);
  ~TcpServer();

  uint16_t port() const { return listener_->address().port; }
  uint64_t instance() const { return instance_; }

  // `device`: the segment is device memory of that ordinal, served through
  // the staging pool (set_staging); -1: host memory, served in place.
  void add_segment(uint32_t id, uint64_t base, uint64_t bytes, uint8_t access, int device = -1);
  // How device segments are served: each chunk of a frame's ranges is
  // gathered (reads) or scattered (writes) by one batched device copy
  // between the segment and a slot of `pool`, under the segments' shared
  // lock until it completed, and the socket moves the slot. Before the
  // first device segment is added.
  void set_staging(std::shared_ptr<StagingPool> pool, std::shared_ptr<DeviceSide> side, DeviceRunOptions options);
  // When it returns, no stream touches [base, base + bytes) of `id` again.
  void remove_segment(uint32_t id);
  // Writes of streams that opened as `label` may land in `places` (spans
  // and their repeats, grant_set.h) of segments with kAccessByGrant until
  // revoke(grant); a write with a range outside the union of the write
  // grants to its label is refused whole (Error
  // permission_denied), its bytes read and dropped. When revoke() returns,
  // no byte of a write lands in a range no remaining grant covers: a frame
  // that was writing there is abandoned and its stream closed. A read
  // grant (`read`) does the same for reads of segments with
  // kAccessReadByGrant: a read outside every read grant to its label is
  // refused whole, and one that a revoke overtakes stops sending. The
  // check's cost grows with the repeats that land around a range, not
  // with the places they name.
  void grant(uint64_t grant, std::string label, const GrantPlaces& places, bool read = false);
  // The places of grant `like` (alive) granted to `label` too, as `grant`:
  // one copy of them for every reader of one hand-off.
  void share(uint64_t grant, std::string label, uint64_t like);
  void revoke(uint64_t grant);

 private:
  struct Conn {
    net::Fd fd;
    std::string peer;                 // the client's label
    std::shared_ptr<net::Slot> slot;  // reapable: an idle stream's place goes to a new client when all are taken
    std::thread thread;
    std::atomic<bool> finished{false};
  };

  TcpServer(std::string label) : label_(std::move(label)) {}
  net::Answer answer(const net::OpenRequest& request);
  void adopt(net::Accepted accepted);
  void serve(Conn* conn, net::Session session);
  Status serve_request(int fd, net::Session& session, uint8_t type, std::string_view payload, const Conn& conn,
                       const std::string& peer);
  // Answers a Digest frame: the hashes of ranges the client may read, or
  // write by grant.
  Status serve_digest(int fd, net::Session& session, std::string_view payload, const Conn& conn,
                      const std::string& peer);
  // Moves the ranges' bytes between the socket and memory, re-validating
  // them whenever a segment was removed or a grant revoked meanwhile.
  Status move_data(int fd, bool to_socket, const std::vector<Range>& ranges, const std::string& prefix,
                   const std::string& label, const std::string& peer);
  // move_data for frames that touch device memory: through a staging slot.
  Status move_staged(int fd, bool to_socket, const std::vector<Range>& ranges, const std::string& prefix,
                     const std::string& label, const std::string& peer);
  // Requires segments_mutex_: OK when the frame's ranges are still
  // registered and granted (checked again only when the epoch moved).
  Status revalidate_locked(const std::vector<Range>& ranges, const std::string& label, bool write,
                           uint64_t* validated_epoch, const std::string& who) const;
  // Requires segments_mutex_: copies chunk `k` between its ranges and
  // `slot` (`to_slot`: gather), device pieces by one batched copy per
  // device, and returns when it completed.
  Status stage_chunk_locked(const Chunk& k, uint8_t* slot, bool to_slot, const std::string& who);
  // Requires segments_mutex_: OK when every range of a write (or read)
  // that needs a grant lies inside a write (read) grant to `label`.
  Status check_granted_locked(const std::vector<Range>& ranges, const std::string& label, bool write) const;
  Status drain(int fd, uint64_t bytes, const std::string& peer);
  std::optional<SegmentSpan> lookup_locked(uint32_t id) const;
  void reap_finished();

  uint64_t instance_ = 0;
  std::string label_;
  std::atomic<bool> stop_{false};

  mutable std::shared_mutex segments_mutex_;
  std::map<uint32_t, SegmentSpan> segments_;
  size_t device_segments_ = 0;      // of segments_, those of device memory
  std::atomic<uint64_t> epoch_{0};  // bumped by every remove_segment and revoke
  // Grants, guarded by segments_mutex_: writes' ([0]) and reads' ([1]), per
  // label, per grant, its places (a grant shared with another label is one
  // set).
  std::map<std::string, std::map<uint64_t, std::shared_ptr<const GrantSet>>> grants_[2];
  std::map<uint64_t, std::pair<bool, std::string>> grant_labels_;  // grant -> (read, label)

  std::shared_ptr<StagingPool> staging_;
  std::shared_ptr<DeviceSide> device_side_;
  DeviceRunOptions device_options_;

  std::mutex conns_mutex_;
  std::list<std::unique_ptr<Conn>> conns_;
  std::map<std::string, size_t> per_peer_;   // streams per client label, guarded by conns_mutex_
  std::unique_ptr<net::Listener> listener_;  // last: stopped first
};

}  // namespace kvbridge::transport::tcp

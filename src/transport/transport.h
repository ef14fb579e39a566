// transport/transport.h: the seam between the engine and the ways bytes move.
//
// A Transport is one way of moving bytes (local memcpy, cma, tcp, ucx,
// cuda_ipc). The
// engine owns one instance of each available transport, tells it about local
// memory segments, and asks it for a Link to a peer. A Link executes resolved
// copies (raw local pointers and the peer's virtual addresses) synchronously
// on the calling engine thread. The engine does all checking (bounds, peer
// registrations) before calling a Link; a transport must still never trust
// numbers that come from the network (tcp frames, ucx messages).
//
// Notifications do not go through transports: the engine sends them on its
// control connection after Link::run() returned OK, which for writes means
// every byte is in the peer's memory (transports must guarantee that: e.g.
// tcp waits for the peer's acknowledgements, ucx flushes the endpoint).
//
// Thread-safety: add_segment/remove_segment are called with the engine's
// registry lock held, never concurrently with each other; connect() is
// called without it (it waits on the peer) and may run concurrently with
// any of them. Link::run may be called from several engine threads at once
// on one Link.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"
#include "kvbridge/transfer_op.h"
#include "transport/grant_set.h"

namespace kvbridge::transport {

using Clock = std::chrono::steady_clock;

// A merged span of registered local memory.
struct Segment {
  uint32_t id = 0;
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  std::string memory = "host";
  // What peers may do to it (RemoteAccess bits: 1 read, 2 write, 4 writes
  // only where granted, 8 reads only where granted (grant()); 0 none: the engine does not
  // advertise it, and transports that serve requests themselves, like tcp,
  // refuse any). cma cannot enforce it: a process allowed to ptrace this one
  // can read and write all its memory.
  uint8_t access = 3;
};

// How an engine names itself to the peers its links open streams to, and how
// a grant names the peer it is for: its name and instance.
std::string engine_label(std::string_view name, uint64_t instance);

// What a peer advertised for one transport: its address blob and, per
// segment, the key blob the transport returned from add_segment on that peer.
struct PeerSegment {
  uint32_t id = 0;
  uint64_t base = 0;  // the peer's virtual address
  uint64_t bytes = 0;
  std::string key;              // transport-specific (a UCX rkey); may be empty
  std::string memory = "host";  // the segment's memory kind, as the peer advertised it
};

struct PeerInfo {
  std::string name;  // the peer engine's name
  uint64_t pid = 0;
  std::string hostname;  // host identity, to decide whether local/cma apply
  std::string address;   // this transport's address blob on the peer
  std::vector<PeerSegment> segments;
};

// One resolved copy: `bytes` between local pointer `local` and the peer's
// address `remote` inside its segment `segment`.
struct Copy {
  uint8_t* local = nullptr;
  uint64_t remote = 0;
  uint64_t bytes = 0;
  uint32_t segment = 0;
};

// Progress of one run: bytes completed, updated as it goes; `cancel` is set by
// the engine (cancel or deadline) and must be checked between chunks.
struct RunControl {
  std::atomic<bool> cancel{false};
  std::atomic<uint64_t> bytes_done{0};
  Clock::time_point deadline = Clock::time_point::max();
  // Runs that touch device memory: events the run waits for before its
  // first copy (the producer's "this KV is ready after this"): IPC event
  // handles, and an event of this process (a device::Event; 0: none).
  // Transports of host memory never see them (the engine refuses them).
  std::vector<std::string> ready_events;
  uintptr_t ready_event = 0;
};

class Link {
 public:
  virtual ~Link() = default;
  // Executes `copies` as reads (peer -> local) or writes (local -> peer).
  // Returns OK when every byte completed (for writes: is in the peer's
  // memory), kCancelled when control.cancel was seen, kTimeout past the
  // deadline, or the first error (kIoError naming the peer, ...). When it
  // returns, for any outcome, no further byte of these copies lands in local
  // memory or leaves it.
  virtual Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) = 0;
  // The peer's segments changed (it registered more memory).
  virtual Status refresh(const PeerInfo& peer) = 0;
  // Asynchronous runs, for links whose transport has its own thread doing
  // the work (ucx): start() hands the copies over and returns at once;
  // `done` is called exactly once, on any thread (the transport's own, or
  // this one if the run fails at once), with what run() would have
  // returned, under the same contract (when `done` runs, no further byte of
  // these copies lands or leaves). `copies` and `control` stay valid until
  // then. `done` must not block and must not call into the transport or
  // take the engine's registry lock. Only called when runs_async().
  virtual bool runs_async() const { return false; }
  virtual void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
                     std::function<void(Status)> done) {
    (void)op, (void)copies, (void)control;
    done(Status::internal("this link has no asynchronous runs"));
  }
  // True when a run is a host-memory copy that finishes in time bounded by
  // its bytes, never waiting on a network or a peer's progress (local,
  // cma). The engine may then execute small transfers on the submitting
  // thread (EngineOptions::inline_bytes). False by default.
  virtual bool runs_inline() const { return false; }
  // The content check (SubmitOptions::verify_content): sets (*hashes)[i] to
  // the xxh3-64 of the peer's bytes of copies[i] (its `remote` side) as
  // they are now, after the run that moved them returned OK. The default
  // reads them again into this process's scratch memory with run(), piece
  // by piece, and hashes them here; a link whose peer can hash its own
  // memory overrides it. Honours control's cancel and deadline; never
  // changes control.bytes_done.
  virtual Status digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes);
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;
  // Whether this transport takes segments of memory kind `memory` ("host",
  // "cuda:N") in add_segment. The engine gives a transport only the
  // segments it serves (the others' keys are empty for it).
  virtual bool serves(std::string_view memory) const { return memory == "host"; }
  // Whether a Link of this transport moves bytes between local memory of
  // one kind (device or host) and peer memory of the other or the same.
  // Host-only transports: host to host.
  virtual bool moves(bool local_device, bool remote_device) const { return !local_device && !remote_device; }
  // This engine's address blob for peers (bounded, at most 4 KiB).
  virtual std::string address() const = 0;
  // Whether this transport can reach `peer` at all (e.g. cma: same host and
  // ptrace allowed). The reason when not.
  virtual Status can_reach(const PeerInfo& peer) const = 0;
  // A local segment appeared; returns its key blob for the metadata (at most
  // 4 KiB; empty when the transport needs none).
  virtual Result<std::string> add_segment(const Segment& segment) = 0;
  virtual Status remove_segment(uint32_t id) = 0;
  virtual Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) = 0;
  // The engine's name and instance, before any connect(): transports whose
  // links name their engine when they open (tcp) use engine_label().
  virtual void set_local_identity(std::string_view name, uint64_t instance) { (void)name, (void)instance; }
  // Writes from the peer whose links open as `label` may land in `places`
  // of segments with access bit 4 (`read`: reads by it may be served from
  // `places` of segments with access bit 8), until revoke(grant); when that
  // returns, no byte of a write outside every remaining write grant lands,
  // and no byte outside every remaining read grant is sent. Only a
  // transport that serves peers' requests itself (tcp) keeps grants: the
  // others' peers reach this process's memory without it. `places` is
  // shared by every transport (a request's grant can be large).
  virtual void grant(uint64_t grant, const std::string& label, std::shared_ptr<const GrantPlaces> places, bool read) {
    (void)grant, (void)label, (void)places, (void)read;
  }
  // The spans of the live grant `like` granted to `label` too, as `grant`.
  virtual void share(uint64_t grant, const std::string& label, uint64_t like) { (void)grant, (void)label, (void)like; }
  virtual void revoke(uint64_t grant) { (void)grant; }
};

// Factories. Each returns kUnavailable, saying why, when it cannot run here.
// How the transports that move device memory (local, cuda_ipc) copy it:
// EngineOptions' device_copy* (device_run.h says what each means).
struct DeviceCopyConfig {
  std::string method = "copy_engine";  // "copy_engine", "kernel" or "auto"
  uint32_t max_blocks = 0;             // the kernel's grid cap (0: default)
  uint64_t kernel_below = 0;           // auto: the kernel for copies of at most this many bytes on average...
  uint32_t kernel_min = 64;            // ...and at least this many of them in the run
};

// How a network transport moves device memory (staging.h): through a pool
// of pinned host memory, `chunk_bytes` at a time (EngineOptions'
// staging_bytes and staging_chunk_bytes).
struct StagingOptions {
  uint64_t pool_bytes = uint64_t{64} << 20;
  uint64_t chunk_bytes = uint64_t{2} << 20;
};

// The bulk data this process's tcp links moved: data frames (Read and
// Write requests' bytes), their bytes, and those under 1 MiB (the demo's
// report and the bench count messages on the wire with it).
struct WireCounts {
  uint64_t frames = 0, bytes = 0, small = 0;
};
WireCounts tcp_wire_counts();

Result<std::unique_ptr<Transport>> make_local_transport(const DeviceCopyConfig& device_copy = {});
Result<std::unique_ptr<Transport>> make_cma_transport();
// tcp: `host` is "host" or "host:port" (port 0 or none: ephemeral), the
// listener binds it; `secret` (empty: none) opens every stream both ways.
// `advertise_host`: the host in address() when not `host` (empty: `host`).
// When the process has a device (device::current()), tcp also serves and
// moves device memory, staged through pinned host memory (`staging`) and
// copied on the device as `device_copy` says.
Result<std::unique_ptr<Transport>> make_tcp_transport(const std::string& host, uint32_t streams,
                                                      const std::string& secret, const std::string& advertise_host = {},
                                                      const StagingOptions& staging = {},
                                                      const DeviceCopyConfig& device_copy = {});
// ucx: `host` is the address the engine binds: UCX's own listeners are kept
// to the interface that holds it (ucx.cc says how). With a device in the
// process, local device memory moves to and from peers' host memory, staged
// as for tcp; the peers' device memory is out of its reach.
Result<std::unique_ptr<Transport>> make_ucx_transport(const std::string& host, const StagingOptions& staging = {},
                                                      const DeviceCopyConfig& device_copy = {});
// cuda_ipc: device memory of another process on this host, through CUDA IPC
// handles (cuda_ipc/cuda_ipc.cc). kUnavailable when the process's device
// (device::current()) has no device; `device_copy` says how it copies.
Result<std::unique_ptr<Transport>> make_cuda_ipc_transport(const DeviceCopyConfig& device_copy = {});

}  // namespace kvbridge::transport

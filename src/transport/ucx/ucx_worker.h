// transport/ucx_worker.h: one UCP context and worker, driven by one thread.
//
// A Worker owns the ucp_context (features RMA and WAKEUP), one ucp_worker
// created in UCS_THREAD_MODE_SINGLE, and the thread that is the only caller of
// UCP from then on: it progresses the worker (which also serves peers that
// read from or write to this process over transports that need the target's
// progress: tcp, and UCP's software RMA over shared memory), runs closures
// handed to call(), and executes the copies of every active run. Engine
// threads never enter UCP; they queue work and wait. This is the
// "correctness first" answer to Link::run being called from several threads:
// one owner, no UCP lock, and a single place that decides what is in flight.
//
// Runs are multiplexed: the thread posts ucp_get_nbx / ucp_put_nbx for every
// active run round-robin, at most kMaxInFlight requests and kMaxInFlightBytes
// bytes in all, copies cut into chunks of at most kChunkBytes so that a cancel
// or a deadline is seen within one chunk per run.
//
// Thread-safety: call(), execute() and start() may be called from any thread. The
// Endpoint and Rkey objects are confined to the worker thread: create, use
// and destroy them only inside call() closures (or on the thread).
// Ownership: Links hold the Worker through shared_ptr (the ucxx pattern), so
// endpoints and remote keys are always released before the worker, and the
// worker before the context (member order in Worker).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace kvbridge::transport::ucx {

inline constexpr size_t kMaxInFlight = 256;
inline constexpr uint64_t kMaxInFlightBytes = uint64_t{64} << 20;
inline constexpr uint64_t kChunkBytes = uint64_t{4} << 20;
// How long a stopped run (cancel, deadline, error) waits for its posted
// requests to complete before the endpoint is closed by force, which
// completes them all as cancelled (UCP_EP_CLOSE_FLAG_FORCE).
inline constexpr std::chrono::milliseconds kStopGrace{200};

// The only translation of ucs_status_t into a Status. `what` names the
// operation, `peer` the peer engine (empty when none). OK for UCS_OK.
Status to_status(ucs_status_t status, std::string_view what, std::string_view peer);

// An unpacked remote key, destroyed on the worker thread.
struct Rkey {
  ucp_rkey_h handle = nullptr;
  Rkey() = default;
  Rkey(const Rkey&) = delete;
  Rkey& operator=(const Rkey&) = delete;
  ~Rkey() {
    if (handle) ucp_rkey_destroy(handle);
  }
};

class Worker;

// One peer's endpoint and remote keys (worker-thread confined). The error
// callback makes the first peer error stick: every later run fails with it.
struct Endpoint {
  Worker* worker = nullptr;
  std::string peer;                                           // the peer engine's name, for messages
  std::string address;                                        // the peer's worker address
  std::map<uint32_t, std::string> keys;                       // packed rkeys by segment id
  ucp_ep_h ep = nullptr;                                      // null until opened, or after a forced close
  std::unordered_map<uint32_t, std::unique_ptr<Rkey>> rkeys;  // for `ep`
  std::vector<std::unique_ptr<Rkey>> retired;                 // dropped while runs were active
  Status broken;                                              // the first peer error
  size_t active_runs = 0;
  // UCP_ERR_HANDLING_MODE_PEER needs transports that detect a dead peer;
  // UCX 1.13's shared memory ones (posix, sysv) do not, so with UCX_TLS=shm
  // the endpoint is made in UCP_ERR_HANDLING_MODE_NONE and the peer's
  // process is watched here instead, through `pidfd` (same host only).
  bool peer_mode = true;
  int pidfd = -1;  // pidfd_open(2) of the peer's pid, or -1
  bool peer_exited = false;
  Clock::time_point last_liveness_check;
  Endpoint() = default;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ~Endpoint();
};

class Worker {
 public:
  // Reads the UCX configuration (UCX_* environment), creates the context,
  // the worker and its thread. kUnavailable with UCX's reason when UCX
  // cannot start here.
  // `net_devices`, when not empty, is set as NET_DEVICES in the UCX
  // configuration (which devices UCX may use and listen on).
  static Result<std::shared_ptr<Worker>> create(const std::string& net_devices = {});
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ucp_context_h context() const { return context_.get(); }
  ucp_worker_h worker() const { return worker_.get(); }
  const std::string& address() const { return address_; }

  // Runs `fn` on the worker thread and returns when it has run (inline
  // when called on the worker thread).
  void call(const std::function<void()>& fn);

  // Executes `copies` over `endpoint` on the worker thread and returns the
  // outcome (the Link::run contract). Requires: `endpoint` stays alive.
  Status execute(Endpoint& endpoint, TransferOp op, std::span<const Copy> copies, RunControl& control);

  // As execute(), but returns at once; `done` gets the outcome on the
  // worker thread (Link::start). Requires: `endpoint`, `copies` and
  // `control` stay alive until then.
  void start(Endpoint& endpoint, TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done);

  // Worker thread only: opens endpoint.ep from its address and unpacks its
  // keys; closes it (by force), releasing its keys.
  Status open(Endpoint& endpoint);
  void close(Endpoint& endpoint);

 private:
  struct Job;
  struct Op;
  struct ContextDeleter {
    void operator()(ucp_context_h c) const { ucp_cleanup(c); }
  };
  struct WorkerDeleter {
    void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
  };

  Worker() = default;
  void loop();
  void wake();
  bool drain_queues();
  void step(Job& job);
  void finish(size_t index);
  void post(Job& job);
  void stop(Job& job, Status why);
  void force_close(Endpoint& endpoint);
  void check_liveness(Endpoint& endpoint);
  void abandon(Endpoint& endpoint);
  // Progresses the worker until `request` completes or `limit` passes, and
  // frees it; false when it had not completed (UCX frees it when it does).
  bool wait_request(void* request, Clock::duration limit);
  static void on_done(void* request, ucs_status_t status, void* user_data);
  static void on_flushed(void* request, ucs_status_t status, void* user_data);
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  // Member order is teardown order, reversed: the thread stops first, then
  // the worker goes, then the context.
  std::unique_ptr<std::remove_pointer_t<ucp_context_h>, ContextDeleter> context_;
  std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, WorkerDeleter> worker_;
  std::string address_;
  int efd_ = -1;      // the worker's event fd (ucp_worker_get_efd)
  int wake_fd_ = -1;  // an eventfd that callers write to wake the thread
  int epoll_fd_ = -1;

  std::mutex mu_;  // guards the queues and the `finished` flags below
  std::condition_variable cv_;
  struct Call {
    const std::function<void()>* fn;
    bool done = false;
  };
  std::deque<Call*> calls_;
  std::deque<Job*> incoming_;
  std::atomic<bool> pending_{false};
  std::atomic<bool> quit_{false};

  // Worker thread only.
  std::vector<Job*> jobs_;
  bool peer_mode_unreachable_ = false;  // PEER mode failed once: go to NONE
  // A peer watched only through its pidfd (NONE mode) whose process exited:
  // it may have died mid-write into this worker's shared memory queue, which
  // then delivers nothing more (UCX 1.13 has no recovery); named in errors.
  std::string exited_unwatched_peer_;
  std::vector<Op> ops_;
  std::vector<Op*> free_ops_;
  uint64_t in_flight_bytes_ = 0;
  std::thread thread_;
  std::thread::id thread_id_;
};

}  // namespace kvbridge::transport::ucx

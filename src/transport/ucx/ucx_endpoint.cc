// The UCP worker thread's endpoints: opening one from a peer's worker
// address (with its remote keys, wireup finished before it is used),
// closing one by force, noticing a peer that died, and the one translation
// of ucs_status_t into a Status. Worker-thread only, like every UCP call
// (ucx_worker.h); the runs that use endpoints are in ucx_worker.cc.
#include <poll.h>
#include <unistd.h>

#include "transport/ucx/ucx_worker.h"

namespace kvbridge::transport::ucx {

// How long connect() waits for a peer to answer the endpoint wireup.
constexpr std::chrono::seconds kWireupTimeout{10};
// How long close() progresses the worker for a forced close to complete.
constexpr std::chrono::seconds kCloseLimit{2};

Status to_status(ucs_status_t status, std::string_view what, std::string_view peer) {
  if (status == UCS_OK) return Status();
  std::string msg = "ucx";
  if (!peer.empty()) msg += " peer '" + std::string(peer) + "'";
  msg += ": " + std::string(what) + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_CANCELED:
      return Status::cancelled(std::move(msg));
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NO_DEVICE:
      return Status::unavailable(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      return Status::resource_exhausted(std::move(msg));
    case UCS_ERR_INVALID_PARAM:
      return Status::invalid_argument(std::move(msg));
    default:
      // Peer gone (UCS_ERR_CONNECTION_RESET, UCS_ERR_ENDPOINT_TIMEOUT,
      // UCS_ERR_UNREACHABLE after start), transport and OS failures.
      return Status::io_error(std::move(msg));
  }
}

Endpoint::~Endpoint() {
  if (pidfd >= 0) ::close(pidfd);
}

void Worker::on_error(void* arg, ucp_ep_h, ucs_status_t status) {
  Endpoint& e = *static_cast<Endpoint*>(arg);
  if (e.broken.ok()) {
    e.broken = to_status(status, "endpoint", e.peer);
    if (e.broken.code() != Code::kIoError) e.broken = Status::io_error(e.broken.message());
  }
}

void Worker::check_liveness(Endpoint& e) {
  if (e.pidfd < 0 || !e.broken.ok()) return;
  Clock::time_point now = Clock::now();
  if (now - e.last_liveness_check < std::chrono::milliseconds(10)) return;
  e.last_liveness_check = now;
  // A pidfd turns readable when the process exits (pidfd_open(2)).
  pollfd p{e.pidfd, POLLIN, 0};
  if (::poll(&p, 1, 0) > 0) {
    e.peer_exited = true;
    e.broken = Status::io_error("ucx peer '" + e.peer + "' is gone: the peer process exited");
    if (!e.peer_mode) exited_unwatched_peer_ = e.peer;
  }
}

Status Worker::open(Endpoint& e) {
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(e.address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Worker::on_error;
  params.err_handler.arg = &e;
  ucs_status_t s = UCS_ERR_UNREACHABLE;
  if (!peer_mode_unreachable_) {
    s = ucp_ep_create(worker_.get(), &params, &e.ep);
    // UCX_TLS=shm: no transport detects a dead peer (UCX logs "no peer
    // failure handler" once); the transports are the same for every peer.
    if (s == UCS_ERR_UNREACHABLE) peer_mode_unreachable_ = true;
  }
  e.peer_mode = s == UCS_OK;
  if (s == UCS_ERR_UNREACHABLE && e.pidfd >= 0) {
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    s = ucp_ep_create(worker_.get(), &params, &e.ep);
  }
  if (s != UCS_OK) {
    e.ep = nullptr;
    return to_status(s, "ucp_ep_create", e.peer);
  }
  for (const auto& [id, key] : e.keys) {
    auto rkey = std::make_unique<Rkey>();
    s = ucp_ep_rkey_unpack(e.ep, key.data(), &rkey->handle);
    if (s != UCS_OK) {
      rkey->handle = nullptr;
      Status err = to_status(s, "ucp_ep_rkey_unpack of segment " + std::to_string(id), e.peer);
      close(e);
      return err;
    }
    e.rkeys[id] = std::move(rkey);
  }
  // Finish the wireup now: a flush completes once the peer has answered. An
  // endpoint torn down (on either side) while wireup messages are still
  // queued trips an assertion inside UCX 1.13 (ucp_request_send_state_ff:
  // "got REP message"), and an unreachable peer is better reported here.
  ucp_request_param_t fp{};
  void* flush = ucp_ep_flush_nbx(e.ep, &fp);
  if (UCS_PTR_IS_ERR(flush)) {
    Status err = to_status(UCS_PTR_STATUS(flush), "ucp_ep_flush_nbx (wireup)", e.peer);
    close(e);
    return err;
  }
  if (flush != nullptr) {
    const Clock::time_point limit = Clock::now() + kWireupTimeout;
    ucs_status_t fs;
    while ((fs = ucp_request_check_status(flush)) == UCS_INPROGRESS && Clock::now() < limit) {
      ucp_worker_progress(worker_.get());
    }
    if (fs == UCS_INPROGRESS) {
      // UCX 1.13 cannot cancel a flush, and one whose answer never comes
      // never completes: hand it back to UCX (freed when it ends, which the
      // forced close below brings about where the transport can).
      ucp_request_free(flush);
      close(e);
      std::string why = "ucx peer '" + e.peer + "': no answer to the endpoint wireup within " +
                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(kWireupTimeout).count()) +
                        " ms";
      if (!e.peer_mode && !exited_unwatched_peer_.empty()) {
        why += " (UCX runs here without a transport that detects a dead peer, and peer '" + exited_unwatched_peer_ +
               "' exited while connected: a process that dies while writing into UCX's shared memory queue "
               "leaves it blocked for good, so this worker receives nothing more; restart the engine, or give "
               "UCX_TLS a transport with peer failure detection such as tcp)";
      }
      return Status::timeout(std::move(why));
    }
    ucp_request_free(flush);
    if (fs != UCS_OK) {
      Status err = to_status(fs, "ucp_ep_flush_nbx (wireup)", e.peer);
      close(e);
      return err;
    }
  }
  return Status();
}

bool Worker::wait_request(void* request, Clock::duration limit) {
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return true;
  const Clock::time_point until = Clock::now() + limit;
  bool done;
  while (!(done = ucp_request_check_status(request) != UCS_INPROGRESS) && Clock::now() < until) {
    ucp_worker_progress(worker_.get());
  }
  ucp_request_free(request);  // one still in progress is freed by UCX when it ends
  return done;
}

void Worker::close(Endpoint& e) {
  if (e.ep != nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucp_ep_h ep = e.ep;
    e.ep = nullptr;
    // A forced close completes at once where the transport can abort its
    // requests; one that cannot (a peer's shared memory queue that never
    // drains) is left to UCX after kCloseLimit rather than spun on forever.
    (void)wait_request(ucp_ep_close_nbx(ep, &p), kCloseLimit);
  }
  // Every request on the endpoint has ended, or (a close past kCloseLimit)
  // will never be progressed for this endpoint again: the keys are free to go.
  e.rkeys.clear();
  e.retired.clear();
}

}  // namespace kvbridge::transport::ucx

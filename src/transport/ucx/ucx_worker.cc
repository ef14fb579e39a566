// The UCP worker thread: progress, closures, and the copies of active runs.
//
// Why one thread and UCS_THREAD_MODE_SINGLE: UCX's multi-thread mode takes a
// worker-wide lock in every call and still leaves completion callbacks to
// whichever thread progresses, so a run could not tell its own completions
// from another run's without more locking of ours. With one owner every
// request, callback and endpoint state change happens on one thread, the
// in-flight bound is global, and a caller only waits on a condition variable.
// The same thread must progress the worker anyway while this process is the
// target of a peer's get/put (UCT tcp and UCP's software RMA over shared
// memory answer on the target's progress), so it sleeps on the worker's event
// fd (UCP_FEATURE_WAKEUP, ucp_worker_arm) when idle.
//
// Cancel: ucp_request_cancel is issued for every outstanding request of a
// stopped run (UCX 1.13 completes RMA requests only when the transport is
// done with them, so it is usually a no-op), then the worker is progressed
// until every callback fired. If that takes longer than kStopGrace (a peer
// that stopped answering), the endpoint is closed with
// UCP_EP_CLOSE_FLAG_FORCE, which completes every outstanding request with
// UCS_ERR_CANCELED and detaches the transport from the local buffers; the
// next run reopens the endpoint. Only then does run() return, so no byte
// lands after it.
//
// Endpoints (open, close, liveness, the UCS status translation) are in
// ucx_endpoint.cc.
#include "transport/ucx/ucx_worker.h"

#include "common/thread_name.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

namespace kvbridge::transport::ucx {

// How long the thread keeps progressing after its last work before it arms
// the worker and sleeps.
constexpr std::chrono::microseconds kSpinBeforeSleep{200};

struct Worker::Op {
  Job* job = nullptr;
  uint64_t bytes = 0;
  void* request = nullptr;  // set once the post returned a request
  bool done = false;
};

struct Worker::Job {
  Worker* worker = nullptr;
  Endpoint* endpoint = nullptr;
  TransferOp op = TransferOp::kRead;
  std::span<const Copy> copies;
  RunControl* control = nullptr;
  size_t next = 0;      // the copy being posted
  uint64_t offset = 0;  // bytes of copies[next] already posted
  size_t outstanding = 0;
  bool flushed = false, flush_pending = false;
  bool stopping = false, forced = false, complete = false;
  Clock::time_point stop_time;
  Status result;
  struct FlushToken {
    Job* job;
  }* flush_token = nullptr;  // the flush callback's user data
  bool finished = false;     // guarded by Worker::mu_
  // Set for start(): the job is on the heap, and `done` replaces `finished`.
  std::function<void(Status)> done;
};

Result<std::shared_ptr<Worker>> Worker::create(const std::string& net_devices) {
  std::shared_ptr<Worker> w(new Worker());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return to_status(s, "ucp_config_read", "").with_context("ucx: cannot read the UCX configuration");
  if (!net_devices.empty()) {
    s = ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return to_status(s, "ucp_config_modify(NET_DEVICES=" + net_devices + ")", "");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // AM is requested for the notification extension (not used yet); RMA for
  // get/put; WAKEUP for the idle thread's event fd.
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return Status::unavailable(to_status(s, "ucp_init", "").message());
  w->context_.reset(context);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  s = ucp_worker_create(context, &wp, &worker);
  if (s != UCS_OK) return Status::unavailable(to_status(s, "ucp_worker_create", "").message());
  w->worker_.reset(worker);

  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  s = ucp_worker_get_address(worker, &address, &address_bytes);
  if (s != UCS_OK) return Status::unavailable(to_status(s, "ucp_worker_get_address", "").message());
  w->address_.assign(reinterpret_cast<const char*>(address), address_bytes);
  ucp_worker_release_address(worker, address);
  if (w->address_.size() > 4096)
    return Status::resource_exhausted("ucx: the worker address is " + std::to_string(w->address_.size()) +
                                      " bytes, over the 4096-byte bound of an address blob (narrow UCX_TLS)");

  s = ucp_worker_get_efd(worker, &w->efd_);
  if (s != UCS_OK) return Status::unavailable(to_status(s, "ucp_worker_get_efd", "").message());
  w->wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  w->epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (w->wake_fd_ < 0 || w->epoll_fd_ < 0) return Status::io_error("ucx: cannot create the wake-up descriptors");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = w->efd_;
  if (::epoll_ctl(w->epoll_fd_, EPOLL_CTL_ADD, w->efd_, &ev) != 0) return Status::io_error("ucx: epoll_ctl");
  ev.data.fd = w->wake_fd_;
  if (::epoll_ctl(w->epoll_fd_, EPOLL_CTL_ADD, w->wake_fd_, &ev) != 0) return Status::io_error("ucx: epoll_ctl");

  w->ops_.resize(kMaxInFlight);
  for (Op& op : w->ops_) w->free_ops_.push_back(&op);
  w->thread_ = std::thread([raw = w.get()] {
    set_thread_name("kvb-ucx");
    raw->loop();
  });
  return w;
}

Worker::~Worker() {
  if (thread_.joinable()) {
    quit_.store(true);
    wake();
    thread_.join();
  }
  // Let queued protocol messages (wireup answers to peers) go out before the
  // worker is destroyed; bounded, and the progress thread has exited.
  if (worker_) {
    const Clock::time_point limit = Clock::now() + std::chrono::milliseconds(20);
    while (ucp_worker_progress(worker_.get()) != 0 && Clock::now() < limit) {
    }
  }
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  // worker_ then context_ are released by their members (reverse order).
}

void Worker::wake() {
  pending_.store(true);
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_, &one, sizeof one);
  (void)n;  // EAGAIN: the counter is already non-zero, the thread will wake.
}

void Worker::call(const std::function<void()>& fn) {
  if (std::this_thread::get_id() == thread_.get_id()) {
    fn();
    return;
  }
  Call c{&fn};
  std::unique_lock<std::mutex> lock(mu_);
  calls_.push_back(&c);
  wake();
  cv_.wait(lock, [&] { return c.done; });
}

Status Worker::execute(Endpoint& endpoint, TransferOp op, std::span<const Copy> copies, RunControl& control) {
  Job job;
  job.worker = this;
  job.endpoint = &endpoint;
  job.op = op;
  job.copies = copies;
  job.control = &control;
  std::unique_lock<std::mutex> lock(mu_);
  incoming_.push_back(&job);
  wake();
  cv_.wait(lock, [&] { return job.finished; });
  return job.result;
}

void Worker::start(Endpoint& endpoint, TransferOp op, std::span<const Copy> copies, RunControl& control,
                   std::function<void(Status)> done) {
  auto* job = new Job();
  job->worker = this;
  job->endpoint = &endpoint;
  job->op = op;
  job->copies = copies;
  job->control = &control;
  job->done = std::move(done);
  std::lock_guard<std::mutex> lock(mu_);
  incoming_.push_back(job);
  wake();
}

bool Worker::drain_queues() {
  if (!pending_.exchange(false)) return false;
  std::deque<Call*> calls;
  std::deque<Job*> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls.swap(calls_);
    incoming.swap(incoming_);
  }
  for (Call* c : calls) {
    (*c->fn)();
    std::lock_guard<std::mutex> lock(mu_);
    c->done = true;
    cv_.notify_all();
  }
  for (Job* job : incoming) {
    Endpoint& e = *job->endpoint;
    Status s = e.broken;
    if (s.ok() && e.ep == nullptr) s = open(e);
    job->result = s;
    job->complete = !s.ok();
    ++e.active_runs;
    jobs_.push_back(job);
  }
  return true;
}

void Worker::loop() {
  epoll_event events[2];
  Clock::time_point last_busy = Clock::now();
  while (true) {
    bool had_work = drain_queues();
    if (quit_.load() && jobs_.empty() && !pending_.load()) break;
    for (size_t i = 0; i < jobs_.size();) {
      if (!jobs_[i]->complete) step(*jobs_[i]);
      if (jobs_[i]->complete) {
        finish(i);
      } else {
        ++i;
      }
    }
    unsigned progressed = ucp_worker_progress(worker_.get());
    if (had_work || progressed > 0 || !jobs_.empty() || pending_.load()) {
      last_busy = Clock::now();
      continue;
    }
    // Just idle: keep progressing for a moment before sleeping. A peer's
    // reply (a flush acknowledgement, the next request of a stream of small
    // transfers) usually comes within microseconds, and waking from
    // epoll_wait costs tens of them.
    if (Clock::now() - last_busy < kSpinBeforeSleep) {
      std::this_thread::yield();
      continue;
    }
    // Idle: sleep until the worker has an event or a caller wakes us. The
    // timeout only bounds the damage of a transport that fails to signal.
    if (ucp_worker_arm(worker_.get()) == UCS_ERR_BUSY) continue;
    int n = ::epoll_wait(epoll_fd_, events, 2, 100);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_fd_) {
        uint64_t v;
        ssize_t r = ::read(wake_fd_, &v, sizeof v);
        (void)r;
      }
    }
  }
}

void Worker::finish(size_t index) {
  Job* job = jobs_[index];
  jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(index));
  Endpoint& e = *job->endpoint;
  if (--e.active_runs == 0) e.retired.clear();
  if (job->done) {
    // Nothing refers to the job any more (no request, no flush token).
    std::function<void(Status)> done = std::move(job->done);
    Status result = std::move(job->result);
    delete job;
    done(std::move(result));
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  job->finished = true;
  cv_.notify_all();
}

void Worker::stop(Job& job, Status why) {
  if (job.stopping) return;
  job.stopping = true;
  job.result = std::move(why);
  job.stop_time = Clock::now();
  for (Op& op : ops_) {
    if (op.job == &job && op.request != nullptr && !op.done) ucp_request_cancel(worker_.get(), op.request);
  }
}

void Worker::step(Job& job) {
  Endpoint& e = *job.endpoint;
  RunControl& control = *job.control;
  if (!e.peer_mode) check_liveness(e);
  if (!job.stopping) {
    if (!e.broken.ok()) {
      stop(job, e.broken);
    } else if (control.cancel.load(std::memory_order_relaxed)) {
      stop(job, Status::cancelled("ucx peer '" + e.peer + "': cancelled"));
    } else if (Clock::now() >= control.deadline) {
      stop(job, Status::timeout("ucx peer '" + e.peer + "': deadline passed with " +
                                std::to_string(control.bytes_done.load()) + " bytes done"));
    }
  }
  if (job.stopping) {
    if (job.outstanding == 0 && !job.flush_pending) {
      job.complete = true;
    } else if (!job.forced && Clock::now() - job.stop_time >= kStopGrace) {
      force_close(e);
      if (!e.peer_mode && e.peer_exited) abandon(e);
      if (job.outstanding == 0 && !job.flush_pending) job.complete = true;
    }
    return;
  }
  post(job);
  if (job.stopping || job.next < job.copies.size() || job.outstanding > 0 || job.flush_pending) return;
  if (job.op == TransferOp::kRead || job.flushed) {
    job.complete = true;
    return;
  }
  // Every put completed locally; the flush completes when every one is in
  // the peer's memory (ucp_ep_flush_nbx: remote completion).
  job.flushed = true;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Worker::on_flushed;
  job.flush_token = new Job::FlushToken{&job};
  p.user_data = job.flush_token;
  job.flush_pending = true;
  ucs_status_ptr_t r = ucp_ep_flush_nbx(e.ep, &p);
  if (!UCS_PTR_IS_PTR(r)) {
    delete job.flush_token;
    job.flush_token = nullptr;
  }
  if (r == nullptr) {
    job.flush_pending = false;
    job.complete = true;
  } else if (UCS_PTR_IS_ERR(r)) {
    job.flush_pending = false;
    stop(job, to_status(UCS_PTR_STATUS(r), "ucp_ep_flush_nbx", e.peer));
  }
}

void Worker::post(Job& job) {
  Endpoint& e = *job.endpoint;
  const bool read = job.op == TransferOp::kRead;
  uint32_t cached_segment = 0;
  Rkey* cached = nullptr;
  while (job.next < job.copies.size() && !free_ops_.empty() && in_flight_bytes_ < kMaxInFlightBytes) {
    const Copy& c = job.copies[job.next];
    uint64_t n = std::min(c.bytes - job.offset, kChunkBytes);
    if (n == 0) {
      ++job.next;
      job.offset = 0;
      continue;
    }
    if (cached == nullptr || cached_segment != c.segment) {
      auto it = e.rkeys.find(c.segment);
      if (it == e.rkeys.end()) {
        stop(job, Status::not_found("ucx peer '" + e.peer + "': no remote key for its segment " +
                                    std::to_string(c.segment)));
        return;
      }
      cached = it->second.get();
      cached_segment = c.segment;
    }
    Op* op = free_ops_.back();
    free_ops_.pop_back();
    *op = Op{&job, n, nullptr, false};
    ++job.outstanding;
    in_flight_bytes_ += n;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &Worker::on_done;
    p.user_data = op;
    uint8_t* local = c.local + job.offset;
    uint64_t remote = c.remote + job.offset;
    ucs_status_ptr_t r = read ? ucp_get_nbx(e.ep, local, n, remote, cached->handle, &p)
                              : ucp_put_nbx(e.ep, local, n, remote, cached->handle, &p);
    job.offset += n;
    if (job.offset == c.bytes) {
      ++job.next;
      job.offset = 0;
    }
    if (UCS_PTR_IS_PTR(r) && !op->done) {
      op->request = r;
      continue;
    }
    if (!op->done) {  // completed at once, or failed to post
      --job.outstanding;
      in_flight_bytes_ -= n;
      if (r == nullptr) job.control->bytes_done.fetch_add(n, std::memory_order_relaxed);
    }
    *op = Op{};
    free_ops_.push_back(op);
    if (UCS_PTR_IS_ERR(r)) {
      stop(job, to_status(UCS_PTR_STATUS(r), read ? "ucp_get_nbx" : "ucp_put_nbx", e.peer));
      return;
    }
  }
}

void Worker::on_done(void* request, ucs_status_t status, void* user_data) {
  Op* op = static_cast<Op*>(user_data);
  if (op->job == nullptr) {  // abandoned (see abandon()): the slot stays out of the pool
    ucp_request_free(request);
    return;
  }
  Job& job = *op->job;
  Worker& w = *job.worker;
  op->done = true;
  --job.outstanding;
  w.in_flight_bytes_ -= op->bytes;
  if (status == UCS_OK) {
    job.control->bytes_done.fetch_add(op->bytes, std::memory_order_relaxed);
  } else if (!job.stopping) {
    // A peer error is reported as the endpoint's error when it has one.
    Status s = job.endpoint->broken;
    if (s.ok()) s = to_status(status, job.op == TransferOp::kRead ? "get" : "put", job.endpoint->peer);
    w.stop(job, std::move(s));
  }
  ucp_request_free(request);
  if (op->request != nullptr) {  // else the post site releases it
    *op = Op{};
    w.free_ops_.push_back(op);
  }
}

void Worker::on_flushed(void* request, ucs_status_t status, void* user_data) {
  auto* token = static_cast<Job::FlushToken*>(user_data);
  Job* abandoned = token->job;
  delete token;
  if (abandoned == nullptr) {
    ucp_request_free(request);
    return;
  }
  Job& job = *abandoned;
  job.flush_token = nullptr;
  job.flush_pending = false;
  if (status != UCS_OK && !job.stopping) {
    Status s = job.endpoint->broken;
    if (s.ok()) s = to_status(status, "flush", job.endpoint->peer);
    job.worker->stop(job, std::move(s));
  }
  ucp_request_free(request);
}

void Worker::abandon(Endpoint& e) {
  // UCX 1.13 purges the requests of a force-closed endpoint only in PEER
  // mode. In NONE mode, once the peer's process has exited nothing more can
  // arrive from it except what it already wrote into our shared memory
  // queues: deliver that first, then forget the rest. Their slots are never
  // reused (op.job is null), so a completion that never comes is harmless.
  for (int idle = 0; idle < 3;) idle = ucp_worker_progress(worker_.get()) > 0 ? 0 : idle + 1;
  for (Op& op : ops_) {
    if (op.job == nullptr || op.job->endpoint != &e || op.done || op.request == nullptr) continue;
    --op.job->outstanding;
    in_flight_bytes_ -= op.bytes;
    op.job = nullptr;
  }
  for (Job* job : jobs_) {
    if (job->endpoint != &e || !job->flush_pending) continue;
    job->flush_token->job = nullptr;
    job->flush_token = nullptr;
    job->flush_pending = false;
  }
}

void Worker::force_close(Endpoint& e) {
  // Every run on this endpoint loses its requests: mark them first, so that
  // their UCS_ERR_CANCELED completions do not overwrite the reason.
  for (Job* job : jobs_) {
    if (job->endpoint != &e) continue;
    job->forced = true;
    if (!job->stopping)
      stop(*job, Status::io_error("ucx peer '" + e.peer +
                                  "': the endpoint was closed because the peer did not "
                                  "complete outstanding requests of a stopped run within " +
                                  std::to_string(kStopGrace.count()) + " ms"));
  }
  close(e);
}

}  // namespace kvbridge::transport::ucx

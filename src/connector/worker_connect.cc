// The worker's connect threads: handshake with remote instances and
// connect to their engines, several instances at once (one attempt per
// instance at a time), then hand the loads parked on an instance back to
// the start thread or fail them. A parked load whose transfer timeout
// passes first fails then (the pump's expire_parked()).
#include "common/text.h"
#include "connector/worker_impl.h"

namespace kvbridge::connector {

// Requires mu_: a connect attempt for `instance` is under way (started
// now unless one is).
void WorkerImpl::request_connect(const std::string& instance) {
  if (!connecting_.insert(instance).second) return;
  connect_errors_.erase(instance);
  connects_.push_back(instance);
  connects_cv_.notify_one();
}

// A connect thread: takes the next instance asked for, handshakes with it
// and connects to its engines; then hands the loads parked on it back to
// the start thread, or fails them with the attempt's error.
void WorkerImpl::connect_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    connects_cv_.wait(lock, [&] { return stop_ || !connects_.empty(); });
    if (stop_) return;
    const std::string instance = std::move(connects_.front());
    connects_.pop_front();
    lock.unlock();
    Status s = connect_now(instance);
    pusher_->answer_pending();  // cancels from ranks of an instance not fetched before
    lock.lock();
    connecting_.erase(instance);
    std::vector<Job> parked = std::move(parked_[instance]);
    parked_.erase(instance);
    for (Job& job : parked) {
      auto qd = queued_.find(job.request);
      if (qd == queued_.end() || qd->second.gen != job.gen) {  // aborted
        if (abandoned(job.request, job.gen)) {
          if (s.ok()) {
            jobs_.push_back(std::move(job));  // the start thread releases its sources
          } else {
            abandoned_.erase(job.request);  // unreachable: the prefill's lease frees its blocks
          }
        }
        continue;
      }
      if (s.ok()) {
        jobs_.push_back(std::move(job));
      } else {
        queued_.erase(qd);
        end_queued(job.request, job.blocks.skip_tokens, unreachable(job, s), false);
      }
    }
    if (s.ok()) jobs_cv_.notify_one();
    connect_errors_[instance] = s;
    results_cv_.notify_all();
    // After connecting_ forgot the attempt: a stream that starts waiting
    // from now on asks for another one, so none waits for an attempt that
    // already told the announcer.
    lock.unlock();
    announcer_->connected(instance, s);
    lock.lock();
  }
}

// Requires mu_: why `job` cannot start, its instance's ranks being
// unreachable (`why`). A hand-off that named its ranks (their incarnations)
// from a process that is gone says so, and how the instance answers now.
Status WorkerImpl::unreachable(const Job& job, const Status& why) const {
  if (job.options.incarnations.empty()) return why;
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
    return out;
  };
  const std::string other = remotes_->elsewhere(job.instance);
  return Status(why.code(), "request " + q(job.request) + " was handed off by " +
                                q(Remotes::instance_of(job.instance)) + " incarnation " +
                                join(job.options.incarnations) +
                                (job.options.addresses.empty() ? "" : " at " + join(job.options.addresses)) +
                                ", which cannot be reached (" + why.message() + "): it restarted or left, and the " +
                                "request's KV went with it" + (other.empty() ? "" : "; " + other + " now"));
}

// Handshakes with every rank of `instance` and connects to each engine.
Status WorkerImpl::connect_now(const std::string& instance) {
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_->fetch(instance));
  for (size_t r = 0; r < fetched->infos.size(); ++r) {
    Result<PeerId> p = remotes_->peer(instance, r);
    if (!p.ok()) return p.error().with_context(instance + " rank " + std::to_string(r) + " engine");
  }
  return Status();
}

}  // namespace kvbridge::connector

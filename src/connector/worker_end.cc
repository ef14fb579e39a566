// How a load ends: a stage that landed, a load over or never started
// (reported, its outcome kept for wait_for_layer()), and a started load's
// settling (its grants revoked, its transfers released, the counters).
#include "connector/worker_impl.h"

namespace kvbridge::connector {

// Requires mu_: every transfer of `st` ended done.
void WorkerImpl::land(Load& load, LoadStage& st) {
  st.landed = true;
  st.items = {};
  st.runs = {};
  for (uint32_t l = st.first_layer; l < st.end_layer; ++l) --load.layer_left[l];
  results_cv_.notify_all();
}

// Requires mu_: the load is over (nothing in flight); reports it.
void WorkerImpl::end_load(std::map<RequestId, Load>::iterator it) {
  Load& load = it->second;
  finish(load);
  report(std::move(load.result));
  loads_.erase(it);
}

// Requires mu_: a queued load that never started ended with `error`
// (aborted, or its handshake, plan or submit failed); reports it.
void WorkerImpl::end_queued(const RequestId& request, uint64_t skip_tokens, Status error, bool aborted) {
  LoadResult r;
  r.request = request;
  r.error = std::move(error);
  r.aborted = aborted;
  r.first_bad_token = skip_tokens;
  ++(aborted ? stats_.loads_aborted : stats_.loads_failed);
  report(std::move(r));
}

// Requires mu_: `result` is a load's last word.
void WorkerImpl::report(LoadResult result) {
  ended_[result.request] = result.error;
  ended_order_.push_back(result.request);
  if (ended_order_.size() > kEndedKept) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  results_.push_back(std::move(result));
  results_cv_.notify_all();
}

void WorkerImpl::release_holds(Load& load) {
  for (GrantId g : load.grants) engine_.revoke_writes(g);
  load.grants.clear();
  for (PreparedId& list : load.lists) {
    if (list == 0) continue;
    (void)engine_.release_prepared(std::exchange(list, 0));
    lists_held_.fetch_sub(1, std::memory_order_relaxed);
  }
}

// Requires mu_: nothing of `load` is in flight.
void WorkerImpl::finish(Load& load) {
  release_holds(load);
  std::vector<TransferStatus> statuses;
  for (const LoadTransfer& t : load.transfers) {
    statuses.push_back(engine_.status(t.id));
    (void)engine_.release(t.id);
  }
  settle(load, statuses, order_, options_.transfer_timeout, Clock::now());
  if (load.aborted) {
    ++stats_.loads_aborted;
  } else if (load.result.error.ok()) {
    ++stats_.loads_ok;
  } else {
    ++stats_.loads_failed;
  }
}

}  // namespace kvbridge::connector

// RemoteSync: discovered instances into a ConnectorWorker (kvbridge/discovery_sync.h).
#include "kvbridge/discovery_sync.h"

namespace kvbridge {

void RemoteSync::on_event(InstanceEvent event, const InstanceRecord& record) {
  if (record.role != options_.role || record.id == options_.self) return;
  if (event == InstanceEvent::kRemoved) {
    // It left (or its lease ran out while it restarts: it comes back as
    // added). Loads under way keep their ranks; queued ones fail naming it.
    std::lock_guard<std::mutex> l(mu_);
    if (added_.erase(record.id) != 0) (void)worker_.remove_remote(record.id);
    return;
  }
  Status s;
  if (!options_.identity.empty() && record.identity != options_.identity) {
    s = Status::incompatible("instance '" + record.id + "' has layout identity " + record.identity + ", this rank " +
                             options_.identity);
  } else {
    // kChanged with new addresses (a restart, a move): they replace the old
    // ones, and the next load handshakes with the ranks there.
    s = worker_.add_remote(record.id, record.ranks);
    if (s.ok() && options_.connect) s = worker_.connect(record.id);
    s = s.with_context("discovered instance '" + record.id + "'");
  }
  std::lock_guard<std::mutex> l(mu_);
  if (s.ok()) {
    added_.insert(record.id);
  } else {
    last_error_ = s;
  }
}

std::set<std::string> RemoteSync::added() const {
  std::lock_guard<std::mutex> l(mu_);
  return added_;
}

Status RemoteSync::last_error() const {
  std::lock_guard<std::mutex> l(mu_);
  return last_error_;
}

}  // namespace kvbridge

// RemoteSync: discovered instances into a ConnectorWorker (kvbridge/discovery_sync.h).
#include "kvbridge/discovery_sync.h"

namespace kvbridge {

void RemoteSync::on_event(InstanceEvent event, const InstanceRecord& record) {
  if (event == InstanceEvent::kRemoved || record.role != options_.role || record.id == options_.self) return;
  Status s;
  if (!options_.identity.empty() && record.identity != options_.identity) {
    s = Status::incompatible("instance '" + record.id + "' has layout identity " + record.identity + ", this rank " +
                             options_.identity);
  } else {
    // kChanged with new addresses: the worker refuses them once it fetched
    // the old ones (kAlreadyExists); that is reported, not hidden.
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

// kvbridge/discovery_sync.h: keeps a ConnectorWorker's remotes in step with
// the instances a discovery Watcher sees.
//
// The connector does not depend on discovery, and discovery does not know
// the connector; this adapter, one layer above both, is the whole of their
// meeting. Give RemoteSync::callback() to Watcher::create(): each added
// instance of the wanted role is passed to add_remote() and connect() (the
// handshake runs on the worker's connect thread; nothing here waits on the
// network); a changed one (restarted or moved: other addresses) replaces
// what the worker knew, so its next loads handshake with the ranks there;
// a removed one is forgotten (remove_remote(): loads under way keep their
// ranks, queued ones fail naming it). Every membership change takes the same
// path as a static add_remote().
//
// Thread-safety: the callback runs on the watcher's thread; the accessors
// may be called from any thread. Ownership: the worker must outlive the
// RemoteSync, and the RemoteSync the Watcher it feeds.
#pragma once

#include <mutex>
#include <set>
#include <string>

#include "kvbridge/connector.h"
#include "kvbridge/discovery.h"

namespace kvbridge {

struct RemoteSyncOptions {
  std::string role = "prefill";  // the instances to add; others are ignored
  // This rank's compatibility_hash_hex(): an instance with another identity
  // is not added (its handshake would fail). Empty: no check here.
  std::string identity;
  std::string self;     // this instance's id, never added as a remote
  bool connect = true;  // also connect() each added instance ahead of its first load
};

class RemoteSync {
 public:
  RemoteSync(ConnectorWorker& worker, RemoteSyncOptions options) : worker_(worker), options_(std::move(options)) {}

  // The Watcher callback; see above.
  InstanceCallback callback() {
    return [this](InstanceEvent event, const InstanceRecord& record) { on_event(event, record); };
  }
  void on_event(InstanceEvent event, const InstanceRecord& record);

  // The instances given to add_remote() so far.
  std::set<std::string> added() const;
  // The last instance refused (identity, protocol, add_remote's error), naming it; OK if none.
  Status last_error() const;

 private:
  ConnectorWorker& worker_;
  const RemoteSyncOptions options_;
  mutable std::mutex mu_;
  std::set<std::string> added_;
  Status last_error_;
};

}  // namespace kvbridge

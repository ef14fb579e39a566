// python/src/engine_wrapper.h: the Python Engine object, shared by engine.cc
// and connector.cc.
//
// It owns the C++ Engine and a reference to every Python object whose memory
// is registered, so that memory cannot be freed by Python while the engine
// may read or write it. ConnectorWorkers hold a reference to their
// PyEngine (a child holds its parent), so teardown order is structural: the
// engine goes last.
//
// Thread-safety: called with the GIL held; the C++ Engine itself is
// thread-safe, so blocking calls release the GIL around it.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "bindings.h"
#include "kvbridge/engine.h"

namespace kvbridge::python {

class PyEngine {
 public:
  explicit PyEngine(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}

  // kUnavailable after close().
  Engine& get() {
    if (!engine_) throw_status(Status::unavailable("the engine is closed"));
    return *engine_;
  }
  bool closed() const { return engine_ == nullptr; }

  // Cancels transfers, closes peers and joins threads; then drops the
  // references to registered objects. kUnavailable while a ConnectorWorker
  // of this engine is open. Idempotent.
  void close() {
    if (!engine_) return;
    if (workers_ > 0) {
      throw_status(Status::unavailable("the engine still has " + std::to_string(workers_) +
                                       " open ConnectorWorker(s): close them first"));
    }
    {
      py::gil_scoped_release nogil;
      engine_.reset();
    }
    keep_.clear();
  }

  void keep(RegionId id, py::object owner) { keep_[id].push_back(std::move(owner)); }
  void drop(RegionId id) {
    auto it = keep_.find(id);
    if (it == keep_.end()) return;
    it->second.pop_back();
    if (it->second.empty()) keep_.erase(it);
  }

  void add_worker() { ++workers_; }
  void remove_worker() { --workers_; }

 private:
  std::unique_ptr<Engine> engine_;
  std::map<RegionId, std::vector<py::object>> keep_;  // one entry per registration reference
  int workers_ = 0;
};

}  // namespace kvbridge::python

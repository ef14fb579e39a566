// connector/worker_internal.h: what a worker learnt of a remote instance,
// for tools and tests (the demo's raw process_vm_readv baseline, the Python
// tests): not part of the library's API, which never exposes peers' addresses.
// Thread-safety: as the worker's methods.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvbridge/connector.h"

namespace kvbridge::connector_internal {

// What the handshake told a rank about one remote rank.
struct RemoteRankView {
  Layout layout;
  int32_t pid = 0;
  std::vector<uint64_t> tensor_bases;  // per layout tensor
};

// The ranks of `instance` as `worker` (made by ConnectorWorker::create)
// fetched them, in tp_rank order. kNotFound before the first load from that
// instance; kInvalidArgument for a worker of another implementation.
Result<std::vector<RemoteRankView>> remote_ranks(const ConnectorWorker& worker, const std::string& instance);

}  // namespace kvbridge::connector_internal

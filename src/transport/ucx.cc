// The ucx transport: not yet implemented in this commit.
#include "transport/transport.h"

namespace kvbridge::transport {

Result<std::unique_ptr<Transport>> make_ucx_transport() {
#ifdef KVB_HAVE_UCX
  return Status::unavailable("ucx: the UCX transport is not implemented yet");
#else
  return Status::unavailable("ucx: built without UCX: install libucx-dev and reconfigure");
#endif
}

}  // namespace kvbridge::transport

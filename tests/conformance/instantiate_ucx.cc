// The conformance and fault suites over the ucx transport, with the peer in a
// peer_main child process (a real kill for "peer gone"). UCX picks its
// transports from UCX_TLS (default selection when unset); ctest sets
// UCX_LOG_LEVEL=error for this binary.
#include "conformance/conformance.h"

#if defined(KVB_HAVE_UCX)

namespace kvbridge::conformance {

INSTANTIATE_TEST_SUITE_P(Ucx, TransportConformance, ::testing::Values(ConformanceParam{"ucx_child", "ucx", true}),
                         conformance_name);
INSTANTIATE_TEST_SUITE_P(Ucx, FaultInjection, ::testing::Values(ConformanceParam{"ucx_child", "ucx", true}),
                         conformance_name);

}  // namespace kvbridge::conformance

#endif

// The conformance and fault suites over cma (the peer must be another
// process) and tcp (a peer in a child process, and one in this process).
#include "conformance/conformance.h"

namespace kvbridge::conformance {

INSTANTIATE_TEST_SUITE_P(Cma, TransportConformance, ::testing::Values(ConformanceParam{"cma_child", "cma", true}),
                         conformance_name);
INSTANTIATE_TEST_SUITE_P(Cma, FaultInjection, ::testing::Values(ConformanceParam{"cma_child", "cma", true}),
                         conformance_name);
INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance,
                         ::testing::Values(ConformanceParam{"tcp_child", "tcp", true},
                                           ConformanceParam{"tcp_in_process", "tcp", false}),
                         conformance_name);
INSTANTIATE_TEST_SUITE_P(Tcp, FaultInjection, ::testing::Values(ConformanceParam{"tcp_child", "tcp", true}),
                         conformance_name);

}  // namespace kvbridge::conformance

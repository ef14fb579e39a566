// The conformance and fault suites over the local transport: the peer is an
// engine in this process, the link is memcpy wrapped in the fault transport.
#include "conformance/conformance.h"

namespace kvbridge::conformance {

INSTANTIATE_TEST_SUITE_P(Local, TransportConformance, ::testing::Values(ConformanceParam{"local", "local", false}),
                         conformance_name);
INSTANTIATE_TEST_SUITE_P(Local, FaultInjection, ::testing::Values(ConformanceParam{"local", "local", false}),
                         conformance_name);

}  // namespace kvbridge::conformance

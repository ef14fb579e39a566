// kvbridge/verify.h: checks a plan against both layouts without trusting the
// planner.
//
// The verifier fills simulated remote memory with a byte pattern that is a
// function of each byte's semantic coordinate (group, layer, component,
// position in the request, global head, byte in cell), executes the plan's
// descriptors as copies into simulated local memory that starts as a canary
// pattern, and then checks that every byte the request moves holds the
// pattern of its coordinate, and that no other local byte changed. Memory is
// simulated sparsely (only the pages a request touches), so full-size presets
// are verified without allocating their tensors. Its rules for which positions
// move are written independently of the planner's, and it executes the
// descriptors on that memory with its own copies and bounds checks rather
// than through the host executor (execute.h): neither the planner's code nor
// the executor's decides what it checks. It checks plan template instances
// (plan.h) as it checks any plan.
//
// Pure: no I/O, no threads. Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <span>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "kvbridge/status.h"

namespace kvbridge {

struct VerifyReport {
  uint64_t cells_checked = 0;  // semantic cells the request moves
  uint64_t bytes_checked = 0;  // their bytes
  uint64_t bytes_written = 0;  // bytes the plan's descriptors write
};

// OK with a report when the plan is exact, in bounds and touches nothing
// else; otherwise kInternal (the plan is wrong) naming the first bad byte with
// its semantic coordinate, e.g. "local tensor 'kv.3' offset 4096 (group 'full'
// layer 'layers.3' component 'v' position 17 head 2 byte 5) holds 0x1f,
// expected 0xa0", or the planner's input error when the inputs themselves are
// invalid. `check_minimal` also fails a plan with a mergeable pair.
Result<VerifyReport> verify(const Plan& plan, const Layout& local, std::span<const Layout> remotes,
                            const Request& request, bool check_minimal = true);

}  // namespace kvbridge

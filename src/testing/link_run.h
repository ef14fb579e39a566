// testing/link_run.h: one Link::run to its end, for transport tests.
// Header-only, for tests.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "transport/transport.h"

namespace kvbridge::testing {

// Runs `copies` on `link` with a deadline `timeout` from now; on OK, expects
// bytes_done to count every byte of them (the Link contract).
inline Status run_link(transport::Link& link, TransferOp op, const std::vector<transport::Copy>& copies,
                       std::chrono::milliseconds timeout) {
  transport::RunControl control;
  control.deadline = transport::Clock::now() + timeout;
  const Status s = link.run(op, copies, control);
  if (s.ok()) {
    uint64_t total = 0;
    for (const transport::Copy& c : copies) total += c.bytes;
    EXPECT_EQ(control.bytes_done.load(), total) << "an OK run counts every byte done";
  }
  return s;
}

}  // namespace kvbridge::testing

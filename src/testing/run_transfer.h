// Tests' one-liner for a submitted transfer: waits for it, releases it and
// returns its status, failing the test when the submit itself failed.
#pragma once

#include <gtest/gtest.h>

#include <chrono>

#include "kvbridge/engine.h"

namespace kvbridge::testing {

inline TransferStatus run_transfer(Engine& e, Result<TransferId> id,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  EXPECT_TRUE(id.ok()) << id.error().to_string();
  if (!id.ok()) return {};
  TransferStatus st = e.wait(*id, timeout);
  (void)e.release(*id);
  return st;
}

}  // namespace kvbridge::testing

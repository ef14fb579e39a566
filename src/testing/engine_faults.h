// testing/engine_faults.h: an engine whose transports misbehave on purpose,
// for tests, `kvbridge demo --inject` and the Python tests.
//
// Not part of the library: linked by tests, the CLI and the Python module.
// Thread-safety: as Engine::create.
#pragma once

#include <memory>
#include <string_view>

#include "kvbridge/engine.h"

namespace kvbridge::testing {

// Engine::create(options) with faults armed, comma-separated:
//   "delay=MS"              every copy of every transport sleeps MS first (a slow link);
//   "drop-notifications=N"  the next N notifications this engine sends are lost on the way.
//   "drop-done=N"           the same for the next N connector done messages ("kvb/1 done ...") only.
//   "drop-rate=P", "duplicate-rate=P", "seed=S"
//                           each notification is lost, or sent twice, with probability P per mille,
//                           drawn from a generator seeded with S (default 1).
//   "skip-copies=1"         every run reports its bytes moved without moving them: for measuring a
//                           load's host cost without its copies (benchmarks only: the bytes are wrong).
//   "refuse-tables=N"       the next N submits that name a prepared table of moves fail as when the
//                           table's peer regions moved (kUnavailable, "prepare again").
// Empty: exactly Engine::create. kInvalidArgument naming an unknown fault
// or a missing number.
Result<std::unique_ptr<Engine>> create_engine_with_faults(const EngineOptions& options, std::string_view faults);

}  // namespace kvbridge::testing

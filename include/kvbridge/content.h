// kvbridge/content.h: deterministic KV content, for demos, tests and benches.
//
// A real engine's KV cannot be checked after a transfer; a demo's can. These
// functions write into a rank's memory, for one request, a byte pattern that
// is a function of each byte's semantic coordinate only (group name, layer,
// component, position in the request, global head, byte in cell) and of a
// per-request seed, and check it on the receiving rank. Because the pattern
// ignores TP size, block size, block ids and axis order, a decode rank can
// check what it pulled from a prefill rank of any geometry, and stale bytes
// of an earlier request in a reused block never pass.
//
// Which positions a request holds per group kind follows plan.h: attention
// and sliding_window positions [first token, num_tokens) (a window group only
// its last window_tokens), state the final state in the last listed block,
// scratch every position of its one block.
//
// Memory is passed as one span per layout tensor, in layout order, each
// exactly the tensor's bytes (TensorMemory, layout.h). Pure: no I/O, no threads. Thread-safety:
// reentrant (callers keep concurrent writers off the same bytes).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/status.h"

namespace kvbridge {

// Whose block ids of the request to use: GroupBlocks::local or ::remote.
enum class RequestSide : uint8_t { kLocal, kRemote };

// Calls `cell(tensor index, offset, bytes, token)` for every cell the request
// holds at tokens >= first_token on `side` (every head the rank holds), a
// group and a layer at a time, then a block's positions at a time, in
// address order where the layout allows: positions and heads in the order
// their axes lie in memory, and a layer's components innermost when they
// interleave (a token's k and v side by side), else one after the other.
// `token` is the first token of the cell's position (num_tokens - 1 for a
// state, 0 for scratch). Blocks listed as -1 are skipped. kInvalidArgument
// naming the group when a block list is too short or an id is past
// num_blocks.
Status for_each_cell(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token,
                     const std::function<void(size_t tensor, uint64_t offset, uint64_t bytes, uint64_t token)>& cell);

// Writes the pattern of (seed, coordinate) into every cell for_each_cell
// visits. kInvalidArgument when `tensors` does not match the layout.
Status fill_request(const Layout& layout, const Request& request, RequestSide side, uint64_t first_token, uint64_t seed,
                    TensorMemory tensors);

struct ContentReport {
  uint64_t cells = 0;            // cells checked
  uint64_t bytes = 0;            // their bytes
  uint64_t bad_cells = 0;        // cells that did not match
  uint64_t first_bad_token = 0;  // smallest `token` of a bad cell (when bad_cells > 0)
  std::string first_error;       // the first bad byte with its coordinate
};

// Checks every cell the request holds at tokens >= first_token on `side`.
// Mismatches are reported in the report, not as an error; errors are for
// inputs that do not fit the layout.
Result<ContentReport> check_request(const Layout& layout, const Request& request, RequestSide side,
                                    uint64_t first_token, uint64_t seed, TensorMemory tensors);

}  // namespace kvbridge

// kvbridge/layout_json.h: the JSON forms `kvbridge.layout/3` (and /1, /2) and
// `kvbridge.request/1` (docs/formats/layout.md, docs/formats/request.md).
//
// Parsing is strict: unknown fields, wrong types, negative or fractional
// numbers where an unsigned integer is expected, nesting deeper than
// kMaxJsonDepth and inputs larger than kMaxJsonBytes are rejected with a
// message naming the JSON path (e.g. "groups[1].layers[3].components[0].axes[2].stride").
// The parsers never throw and never crash on any input (they are fuzzed).
//
// Writing emits every field, optional ones included, in a fixed order, so
// parse(write(x)) == x and write(parse(write(x))) == write(x).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/status.h"

namespace kvbridge {

inline constexpr size_t kMaxJsonBytes = size_t{64} << 20;
inline constexpr size_t kMaxJsonDepth = 32;
inline constexpr std::string_view kRequestFormat = "kvbridge.request/1";

// Parses and validates (validate()) a layout. On error the message names the
// JSON path or the group/layer/component at fault.
Result<Layout> parse_layout(std::string_view json);

// Writes a layout as JSON. `indent` < 0 writes one line; >= 0 pretty-prints.
std::string to_json(const Layout& layout, int indent = 2);

// What one request transfers: per group, the block ids on each side in request
// order (-1 for a block that moves nothing), the number of tokens, and how
// many leading tokens the receiver already has.
struct GroupBlocks {
  std::vector<int64_t> local;
  std::vector<int64_t> remote;
  bool operator==(const GroupBlocks&) const = default;
};

struct Request {
  uint64_t num_tokens = 0;
  uint64_t skip_tokens = 0;
  std::map<std::string, GroupBlocks> blocks;  // by group name
  bool operator==(const Request&) const = default;
};

inline constexpr size_t kMaxRequestBlocks = size_t{1} << 24;

// Parses a request. Checks the structure only (skip_tokens <= num_tokens, ids
// >= -1, bounded list lengths); whether it fits a pair of layouts is checked
// by the planner.
Result<Request> parse_request(std::string_view json);

std::string to_json(const Request& request, int indent = 2);

}  // namespace kvbridge

// The rule for a tensor's `memory` (DESIGN.md, the layout contract), shared
// by validate() and the JSON reader, which refuses a bad one with the path
// of its field. Not a public header.
//
// Thread-safety: a pure function.
#pragma once

#include <string>

namespace kvbridge::layout_internal {

// "host", or "cuda:" and one to five decimal digits.
bool valid_memory(const std::string& memory);

}  // namespace kvbridge::layout_internal

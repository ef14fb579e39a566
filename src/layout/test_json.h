// Test-only: a case of the layout and request JSON rejection tests. Each
// edits a valid document and expects parsing it to fail with `code` and
// `message` (the whole message, or a part of it when `partial`).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "kvbridge/status.h"

namespace kvbridge::testing {

struct JsonRejection {
  const char* name;
  std::function<void(nlohmann::ordered_json&)> edit;
  Code code;
  std::string message;
  bool partial = false;
};

// GoogleTest names a failing case by its name.
inline void PrintTo(const JsonRejection& r, std::ostream* os) { *os << r.name; }

}  // namespace kvbridge::testing

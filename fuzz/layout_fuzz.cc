// libFuzzer target for the JSON forms: parse_layout() and parse_request() must
// never crash, throw, or leak on any input, and whatever they accept must
// survive a round trip exactly: parse(to_json(x)) == x and the text is stable.
// A broken round trip traps, so the fuzzer reports it as a crash.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"

namespace {

template <typename T, typename Parse>
void check_round_trip(const T& value, Parse parse) {
  for (int indent : {-1, 2}) {
    const std::string text = kvbridge::to_json(value, indent);
    kvbridge::Result<T> back = parse(text);
    if (!back.has_value() || !(*back == value)) __builtin_trap();
    if (kvbridge::to_json(*back, indent) != text) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (kvbridge::Result<kvbridge::Layout> layout = kvbridge::parse_layout(text); layout.has_value()) {
    // parse_layout() returns only valid layouts.
    if (!kvbridge::validate(*layout).ok()) __builtin_trap();
    check_round_trip(*layout, [](std::string_view t) { return kvbridge::parse_layout(t); });
  } else if (layout.error().message().empty()) {
    __builtin_trap();  // Every error names what is wrong.
  }
  if (kvbridge::Result<kvbridge::Request> request = kvbridge::parse_request(text); request.has_value()) {
    if (request->skip_tokens > request->num_tokens) __builtin_trap();
    check_round_trip(*request, [](std::string_view t) { return kvbridge::parse_request(t); });
  } else if (request.error().message().empty()) {
    __builtin_trap();
  }
  return 0;
}

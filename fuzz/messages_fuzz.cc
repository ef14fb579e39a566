// libFuzzer target for the worker-to-worker messages (connector/messages.h):
// notifications any connected peer can send. parse_message() must never
// crash or read out of bounds on any input, and a message it accepts must
// format to text that parses back to the same message (its event and
// reader count included).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "connector/messages.h"

namespace c = kvbridge::connector;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::optional<c::Message> m = c::parse_message(text);
  if (!m) return 0;
  const std::string again = c::format_message(*m);
  const std::optional<c::Message> back = c::parse_message(again);
  if (!back || back->kind != m->kind || back->request != m->request || back->layer != m->layer ||
      back->stage != m->stage || back->stages != m->stages || back->event != m->event || back->readers != m->readers)
    __builtin_trap();
  return 0;
}

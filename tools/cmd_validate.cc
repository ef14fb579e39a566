// `kvbridge validate` (check a layout or a request) and `kvbridge identity`.

#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "kvbridge/layout_json.h"

namespace kvbridge::cli {
namespace {

// The "format" field of a JSON object, or "" when there is none (the parsers
// then report what is wrong).
std::string format_of(const std::string& text) {
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_object()) {
    auto it = doc.find("format");
    if (it != doc.end() && it->is_string()) return it->get<std::string>();
  }
  return "";
}

int run_validate(const std::string& path) {
  Result<std::string> text = read_input(path);
  if (!text) return fail(text.error());
  if (format_of(*text) == kRequestFormat) {
    Result<Request> request = parse_request(*text);
    if (!request) return fail(request.error().with_context(path));
    std::cout << "valid: request of " << request->num_tokens << " tokens (" << request->skip_tokens
              << " already held), " << request->blocks.size() << " groups\n";
    return 0;
  }
  Result<Layout> layout = parse_layout(*text);
  if (!layout) return fail(layout.error().with_context(path));
  size_t layers = 0, held = 0;
  for (const Group& g : layout->groups) {
    layers += g.layers.size();
    for (const Layer& l : g.layers) held += l.held;
  }
  std::cout << "valid: " << layout->model << " tp " << layout->tp_rank << "/" << layout->tp_size;
  if (layout->pp_size > 1) std::cout << " pp " << layout->pp_rank << "/" << layout->pp_size;
  std::cout << ", " << layout->groups.size() << " groups, " << layers << " layers";
  if (held != layers) std::cout << " (" << held << " held)";
  std::cout << ", compatibility hash " << compatibility_hash_hex(*layout) << "\n";
  return 0;
}

int run_identity(const std::string& path) {
  Result<std::string> text = read_input(path);
  if (!text) return fail(text.error());
  Result<Layout> layout = parse_layout(*text);
  if (!layout) return fail(layout.error().with_context(path));
  const std::string identity = identity_text(*layout);
  std::cout << "compatibility hash " << compatibility_hash_hex(*layout) << "\n" << identity;
  if (!identity.empty() && identity.back() != '\n') std::cout << "\n";
  return 0;
}

}  // namespace

Command add_validate_command(CLI::App& root) {
  auto path = std::make_shared<std::string>();
  CLI::App* app =
      root.add_subcommand("validate", "Check a layout (kvbridge.layout/3) or a request (kvbridge.request/1)");
  app->add_option("file", *path, "JSON file, or - for stdin")->required();
  return {app, [path] { return run_validate(*path); }};
}

Command add_identity_command(CLI::App& root) {
  auto path = std::make_shared<std::string>();
  CLI::App* app =
      root.add_subcommand("identity", "Print a layout's compatibility hash and the identity text it hashes");
  app->add_option("file", *path, "Layout JSON file, or - for stdin")->required();
  return {app, [path] { return run_identity(*path); }};
}

}  // namespace kvbridge::cli

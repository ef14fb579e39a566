// kvbridge.request/1: parse_request() and to_json(const Request&).
//
// Only the structure is checked here; whether the block lists fit a pair of
// layouts (enough blocks for num_tokens, ids below num_blocks, groups that
// exist) is the planner's business, since only it sees both layouts.
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "layout/json_io.h"

namespace kvbridge {
namespace {

using json_io::Json;
using json_io::ObjectReader;
using json_io::OrderedJson;
using json_io::path_error;
using json_io::quote_text;

Result<int64_t> read_block_id(const Json& value, const std::string& path) {
  constexpr uint64_t kMaxId = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (value.is_number_unsigned() && value.get<uint64_t>() <= kMaxId) {
    return static_cast<int64_t>(value.get<uint64_t>());
  }
  // nlohmann stores a non-negative literal as unsigned, so a signed integer
  // here was written with a minus sign ("-0" included, accepted as 0).
  if (value.is_number_integer() && !value.is_number_unsigned() && value.get<int64_t>() >= -1) {
    return value.get<int64_t>();
  }
  return path_error(path, "expected a block id (an integer from -1 to 2^63-1), got " + json_io::describe(value));
}

Result<std::vector<int64_t>> read_block_list(const ObjectReader& r, std::string_view key) {
  KVB_ASSIGN_OR_RETURN(const Json* list, r.array_field(key, kMaxRequestBlocks));
  const std::string path = r.child(key);
  std::vector<int64_t> ids;
  ids.reserve(list->size());
  for (size_t i = 0; i < list->size(); ++i) {
    KVB_ASSIGN_OR_RETURN(int64_t id, read_block_id((*list)[i], json_io::index_path(path, i)));
    ids.push_back(id);
  }
  return ids;
}

Result<Request> read_request(std::string_view text) {
  KVB_ASSIGN_OR_RETURN(Json doc, json_io::parse_document(text));
  KVB_RETURN_IF_ERROR(json_io::expect_object(doc, ""));
  ObjectReader r(doc, "");
  KVB_ASSIGN_OR_RETURN(std::string format, r.string_field("format"));
  if (format != kRequestFormat) {
    return path_error("format", "expected " + quote_text(kRequestFormat) + ", got " + quote_text(format));
  }
  KVB_RETURN_IF_ERROR(r.check_fields({"format", "num_tokens", "skip_tokens", "blocks"}));
  Request request;
  KVB_ASSIGN_OR_RETURN(request.num_tokens, r.unsigned_field("num_tokens", UINT64_MAX));
  KVB_ASSIGN_OR_RETURN(request.skip_tokens, r.unsigned_field_or("skip_tokens", UINT64_MAX, 0));
  if (request.skip_tokens > request.num_tokens) {
    return path_error("skip_tokens", std::to_string(request.skip_tokens) + " is larger than num_tokens " +
                                         std::to_string(request.num_tokens));
  }
  KVB_ASSIGN_OR_RETURN(const Json* blocks, r.require("blocks"));
  KVB_RETURN_IF_ERROR(json_io::expect_object(*blocks, "blocks"));
  if (blocks->size() > kMaxGroups) {
    return path_error(
        "blocks",
        "has " + std::to_string(blocks->size()) + " groups, more than the limit of " + std::to_string(kMaxGroups),
        Code::kResourceExhausted);
  }
  for (const auto& [group, value] : blocks->items()) {
    const std::string path = json_io::field_path("blocks", group);
    KVB_RETURN_IF_ERROR(json_io::read_name(Json(group), path).status());
    KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
    ObjectReader g(value, path);
    KVB_RETURN_IF_ERROR(g.check_fields({"local", "remote"}));
    GroupBlocks lists;
    KVB_ASSIGN_OR_RETURN(lists.local, read_block_list(g, "local"));
    KVB_ASSIGN_OR_RETURN(lists.remote, read_block_list(g, "remote"));
    request.blocks.emplace(group, std::move(lists));
  }
  return request;
}

}  // namespace

Result<Request> parse_request(std::string_view json) {
  return json_io::guarded<Request>("request", [&] { return read_request(json); });
}

std::string to_json(const Request& request, int indent) {
  OrderedJson j;
  j["format"] = kRequestFormat;
  j["num_tokens"] = request.num_tokens;
  j["skip_tokens"] = request.skip_tokens;
  j["blocks"] = OrderedJson::object();
  for (const auto& [group, lists] : request.blocks) {
    j["blocks"][group] = {{"local", lists.local}, {"remote", lists.remote}};
  }
  return json_io::write(j, indent);
}

}  // namespace kvbridge

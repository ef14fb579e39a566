// Why this file exists: nlohmann::json throws on every type mismatch and
// accepts duplicate keys (the last one silently wins), and its parse() would
// build an arbitrarily deep DOM. The formats are public contracts fed by users
// and peers, so every accessor here checks the type first, and the raw text is
// bounded before nlohmann sees it.
#include "layout/json_io.h"

#include <algorithm>
#include <optional>
#include <set>
#include <vector>

#include "common/text.h"
#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"

namespace kvbridge::json_io {
namespace {

// Rejects nesting deeper than kMaxJsonDepth (common/text.h).
Status check_depth(std::string_view text) {
  if (const std::optional<size_t> at = json_nesting_past(text, kMaxJsonDepth)) {
    return Status::resource_exhausted("JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels (at byte " +
                                      std::to_string(*at) + ")");
  }
  return Status();
}

// Tracks the path of the value being parsed so that a repeated key can be
// reported where it is. One frame per open object or array.
class DuplicateKeyFinder {
 public:
  bool on_event(Json::parse_event_t event, const Json& parsed) {
    using E = Json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        count_element();
        frames_.push_back(Frame{event == E::object_start, {}, 0, {}});
        break;
      case E::object_end:
      case E::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case E::key:
        if (!frames_.empty() && parsed.is_string()) {
          Frame& top = frames_.back();
          top.key = parsed.get_ref<const std::string&>();
          if (!top.keys.insert(top.key).second && error_.ok()) {
            error_ = path_error(object_path(), "duplicate field " + quote_text(top.key));
          }
        }
        break;
      case E::value:
        count_element();
        break;
    }
    return true;  // Keep every value; the first duplicate is reported after parsing.
  }

  const Status& error() const { return error_; }

 private:
  struct Frame {
    bool object;
    std::string key;  // current key, for objects
    size_t elements;  // elements seen so far, for arrays
    std::set<std::string> keys;
  };

  void count_element() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().elements;
  }

  // Path of the innermost open object.
  std::string object_path() const {
    std::string path;
    for (size_t i = 0; i + 1 < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      path = f.object ? field_path(path, f.key) : index_path(path, f.elements - 1);
    }
    return path;
  }

  std::vector<Frame> frames_;
  Status error_;
};

bool is_identifier(std::string_view key) {
  if (key.empty()) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// Levenshtein distance, for "did you mean" on short keys.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string expected(std::string_view what, const Json& value) {
  return "expected " + std::string(what) + ", got " + describe(value);
}

}  // namespace

Result<Json> parse_document(std::string_view text) {
  if (text.size() > kMaxJsonBytes) {
    return Status::resource_exhausted("the JSON text is " + std::to_string(text.size()) +
                                      " bytes, more than the limit of " + std::to_string(kMaxJsonBytes));
  }
  KVB_RETURN_IF_ERROR(check_depth(text));
  DuplicateKeyFinder finder;
  Json::parser_callback_t callback = [&finder](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    return finder.on_event(event, parsed);
  };
  Json doc = Json::parse(text, callback, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    // The non-throwing parse says only that the text is invalid; parse again
    // with exceptions, caught here, for nlohmann's line and column.
    // nlohmann throws parse_error for syntax and out_of_range for a number
    // too large for a double ("1e400").
    std::string why = "invalid JSON";
    try {
      [[maybe_unused]] Json reparsed = Json::parse(text);
    } catch (const Json::exception& e) {
      std::string_view what = e.what();
      // Drop the "[json.exception.parse_error.101] " prefix.
      if (size_t end = what.find("] "); !what.empty() && what[0] == '[' && end != std::string_view::npos) {
        what.remove_prefix(end + 2);
      }
      why += ": " + std::string(what);
    }
    return Status::invalid_argument(why);
  }
  KVB_RETURN_IF_ERROR(finder.error());
  return doc;
}

std::string field_path(const std::string& parent, std::string_view key) {
  if (!is_identifier(key)) return parent + "[" + quote_text(key) + "]";
  if (parent.empty()) return std::string(key);
  return parent + "." + std::string(key);
}

std::string index_path(const std::string& parent, size_t index) { return parent + "[" + std::to_string(index) + "]"; }

std::string quote_text(std::string_view text) {
  constexpr size_t kMaxQuotedBytes = 64;
  bool cut = text.size() > kMaxQuotedBytes;
  if (cut) {
    text = text.substr(0, kMaxQuotedBytes);
    // Do not split a UTF-8 sequence: drop continuation bytes and their lead.
    while (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0x80) text.remove_suffix(1);
    if (!text.empty() && static_cast<unsigned char>(text.back()) >= 0xC0) text.remove_suffix(1);
  }
  std::string out;
  try {
    out = Json(std::string(text)).dump(-1, ' ', false, Json::error_handler_t::replace);
  } catch (const std::exception&) {
    out = "\"?\"";
  }
  if (cut) out += "...";
  return out;
}

std::string describe(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return value.get<bool>() ? "true" : "false";
    case Json::value_t::number_integer: {
      const int64_t v = value.get<int64_t>();
      return v == 0 ? "-0" : std::to_string(v);  // A signed zero can only come from "-0".
    }
    case Json::value_t::number_unsigned:
      return std::to_string(value.get<uint64_t>());
    case Json::value_t::number_float: {
      try {
        return value.dump();
      } catch (const std::exception&) {
        return "a number";
      }
    }
    case Json::value_t::string:
      return "the string " + quote_text(value.get_ref<const std::string&>());
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::binary:
      return "binary data";
    case Json::value_t::discarded:
      return "nothing";
  }
  return "an unknown value";
}

Status path_error(const std::string& path, std::string_view what, Code code) {
  if (path.empty()) return Status(code, std::string(what));
  return Status(code, path + ": " + std::string(what));
}

Result<uint64_t> read_unsigned(const Json& value, const std::string& path, uint64_t max) {
  if (!value.is_number_unsigned()) return path_error(path, expected("an unsigned integer", value));
  const uint64_t v = value.get<uint64_t>();
  if (v > max) {
    return path_error(path, std::to_string(v) + " is larger than the limit " + std::to_string(max),
                      Code::kResourceExhausted);
  }
  return v;
}

Result<std::string> read_string(const Json& value, const std::string& path) {
  if (!value.is_string()) return path_error(path, expected("a string", value));
  return value.get_ref<const std::string&>();
}

Result<std::string> read_name(const Json& value, const std::string& path) {
  if (!value.is_string()) return path_error(path, expected("a name (a non-empty string)", value));
  const std::string& name = value.get_ref<const std::string&>();
  if (name.empty()) return path_error(path, "expected a name (a non-empty string), got the empty string");
  if (name.size() > kMaxNameBytes) {
    return path_error(path,
                      "the name is " + std::to_string(name.size()) + " bytes, longer than the limit of " +
                          std::to_string(kMaxNameBytes),
                      Code::kResourceExhausted);
  }
  return name;
}

Result<bool> read_bool(const Json& value, const std::string& path) {
  if (!value.is_boolean()) return path_error(path, expected("true or false", value));
  return value.get<bool>();
}

Result<const Json*> read_array(const Json& value, const std::string& path, size_t max_items) {
  if (!value.is_array()) return path_error(path, expected("an array", value));
  if (value.size() > max_items) {
    return path_error(
        path, "has " + std::to_string(value.size()) + " entries, more than the limit of " + std::to_string(max_items),
        Code::kResourceExhausted);
  }
  return &value;
}

Status expect_object(const Json& value, const std::string& path) {
  if (value.is_object()) return Status();
  if (path.empty()) return Status::invalid_argument("expected a JSON object at the top level, got " + describe(value));
  return path_error(path, expected("an object", value));
}

void ObjectReader::set_name(std::string_view name) {
  path_ += " ('";
  path_ += name;
  path_ += "')";
}

Status ObjectReader::check_fields(std::initializer_list<std::string_view> known) const {
  for (const auto& [key, value] : object_.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string message = "unknown field " + quote_text(key);
    if (key.size() <= 64) {
      for (std::string_view k : known) {
        if (edit_distance(key, k) <= 2) {
          message += " (did you mean \"" + std::string(k) + "\"?)";
          break;
        }
      }
    }
    return path_error(path_, message);
  }
  return Status();
}

const Json* ObjectReader::find(std::string_view key) const {
  auto it = object_.find(key);
  return it == object_.end() ? nullptr : &*it;
}

Result<const Json*> ObjectReader::require(std::string_view key) const {
  const Json* v = find(key);
  if (v == nullptr) return path_error(path_, "missing required field " + quote_text(key));
  return v;
}

Result<uint64_t> ObjectReader::unsigned_field(std::string_view key, uint64_t max) const {
  KVB_ASSIGN_OR_RETURN(const Json* v, require(key));
  return read_unsigned(*v, child(key), max);
}

Result<uint64_t> ObjectReader::unsigned_field_or(std::string_view key, uint64_t max, uint64_t fallback) const {
  const Json* v = find(key);
  if (v == nullptr) return fallback;
  return read_unsigned(*v, child(key), max);
}

Result<std::optional<uint64_t>> ObjectReader::nullable_unsigned_field(std::string_view key, uint64_t max) const {
  const Json* v = find(key);
  if (v == nullptr || v->is_null()) return std::optional<uint64_t>();
  if (!v->is_number_unsigned()) return path_error(child(key), expected("an unsigned integer or null", *v));
  KVB_ASSIGN_OR_RETURN(uint64_t n, read_unsigned(*v, child(key), max));
  return std::optional<uint64_t>(n);
}

Result<std::string> ObjectReader::string_field(std::string_view key) const {
  KVB_ASSIGN_OR_RETURN(const Json* v, require(key));
  return read_string(*v, child(key));
}

Result<std::string> ObjectReader::name_field(std::string_view key) const {
  KVB_ASSIGN_OR_RETURN(const Json* v, require(key));
  return read_name(*v, child(key));
}

Result<bool> ObjectReader::bool_field_or(std::string_view key, bool fallback) const {
  const Json* v = find(key);
  if (v == nullptr) return fallback;
  return read_bool(*v, child(key));
}

Result<const Json*> ObjectReader::array_field(std::string_view key, size_t max_items) const {
  KVB_ASSIGN_OR_RETURN(const Json* v, require(key));
  return read_array(*v, child(key), max_items);
}

namespace {

std::string write_scalar(const OrderedJson& value) {
  return value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

bool all_scalars(const OrderedJson& value) {
  return std::none_of(value.begin(), value.end(), [](const OrderedJson& v) { return v.is_structured(); });
}

void write_to(const OrderedJson& value, int indent, int level, std::string& out) {
  if (!value.is_structured()) {
    out += write_scalar(value);
    return;
  }
  const bool object = value.is_object();
  const char open = object ? '{' : '[';
  const char close = object ? '}' : ']';
  if (value.empty()) {
    out += open;
    out += close;
    return;
  }
  const bool one_line = indent < 0 || all_scalars(value);
  const std::string separator = indent < 0 ? "," : (one_line ? ", " : ",");
  const std::string colon = indent < 0 ? ":" : ": ";
  const std::string inner = one_line ? "" : "\n" + std::string(static_cast<size_t>(indent) * (level + 1), ' ');
  out += open;
  bool first = true;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!first) out += separator;
    first = false;
    out += inner;
    if (object) {
      out += write_scalar(OrderedJson(it.key()));
      out += colon;
    }
    write_to(*it, indent, level + 1, out);
  }
  if (!one_line) out += "\n" + std::string(static_cast<size_t>(indent) * level, ' ');
  out += close;
}

}  // namespace

std::string write(const OrderedJson& value, int indent) {
  std::string out;
  write_to(value, indent, 0, out);
  return out;
}

}  // namespace kvbridge::json_io

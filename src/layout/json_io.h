// Strict, non-throwing reading and deterministic writing of JSON documents
// for the kvbridge formats (kvbridge.layout/1, kvbridge.request/1). Internal
// to the layout library.
//
// parse_document() turns text into a nlohmann::json value after the checks
// that must happen before a DOM exists (size, nesting depth) and with the
// checks nlohmann does not do (duplicate keys). ObjectReader then reads one
// JSON object field by field, checking the type of every value before it is
// touched, so no nlohmann accessor can throw. Every error message starts with
// the JSON path of the culprit, e.g.
//   "groups[0] ('full').layers[3] ('layers.3').components[0] ('k').cell_bytes: ..."
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::json_io {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Writes `value` with keys in insertion order. indent < 0: one line, no
// spaces. indent >= 0: one line per member, except that an array or object
// whose members are all scalars is written on one line (an axis, a head map,
// a list of block ids), which keeps large layouts readable. Strings that are
// not valid UTF-8 have the bad bytes replaced by U+FFFD. Never throws except
// std::bad_alloc.
std::string write(const OrderedJson& value, int indent);

// Parses `text` as one JSON value. Returns kResourceExhausted when the text is
// longer than kMaxJsonBytes or nests arrays and objects deeper than
// kMaxJsonDepth (checked on the raw text first, so that no parser recursion
// ever sees deep input), and kInvalidArgument for a syntax error (with line
// and column) or an object that repeats a key (with the path).
Result<Json> parse_document(std::string_view text);

// Runs `read` (a parser that checks types before every access) and turns
// anything it still throws into a Status, so no exception crosses the
// library boundary even on allocation failure. `what` names the document.
template <typename T, typename F>
Result<T> guarded(std::string_view what, F&& read) {
  try {
    return read();
  } catch (const std::bad_alloc&) {
    return Status::resource_exhausted("out of memory while parsing the " + std::string(what));
  } catch (const std::exception& e) {
    return Status::internal("unexpected error while parsing the " + std::string(what) + ": " + e.what());
  }
}

// Paths. The root is the empty path. A key that is not a plain identifier
// ([A-Za-z0-9_-]+) is written quoted in brackets: blocks["a b"].
std::string field_path(const std::string& parent, std::string_view key);
std::string index_path(const std::string& parent, size_t index);

// A value for an error message: -4, 2.5, true, null, the string "16", an
// array, an object.
std::string describe(const Json& value);

// `text` as a JSON string literal for a message, cut after 64 bytes.
std::string quote_text(std::string_view text);

// kInvalidArgument (or `code`) with message "<path>: <what>", or just <what>
// at the root.
Status path_error(const std::string& path, std::string_view what, Code code = Code::kInvalidArgument);

// Checks the type of `value` (at `path`) and reads it. Each returns
// kInvalidArgument naming the path and the value found on a wrong type, and
// kResourceExhausted when a bound is exceeded.
Result<uint64_t> read_unsigned(const Json& value, const std::string& path, uint64_t max);
Result<std::string> read_string(const Json& value, const std::string& path);
// A non-empty string of at most kMaxNameBytes bytes.
Result<std::string> read_name(const Json& value, const std::string& path);
Result<bool> read_bool(const Json& value, const std::string& path);
// An array of at most `max_items` entries.
Result<const Json*> read_array(const Json& value, const std::string& path, size_t max_items);
Status expect_object(const Json& value, const std::string& path);

// Reads the fields of one JSON object. Requires: `object` is an object and
// outlives the reader.
class ObjectReader {
 public:
  ObjectReader(const Json& object, std::string path) : object_(object), path_(std::move(path)) {}

  // The object's path; after set_name() it carries the name: "groups[0] ('full')".
  const std::string& path() const { return path_; }
  void set_name(std::string_view name);
  std::string child(std::string_view key) const { return field_path(path_, key); }

  // kInvalidArgument naming the first key that is not in `known`, with a
  // suggestion when a known key is one or two edits away.
  Status check_fields(std::initializer_list<std::string_view> known) const;

  // The value of `key`, or nullptr when absent.
  const Json* find(std::string_view key) const;
  // The value of `key`, or kInvalidArgument "missing required field".
  Result<const Json*> require(std::string_view key) const;

  Result<uint64_t> unsigned_field(std::string_view key, uint64_t max) const;
  // `fallback` when the key is absent.
  Result<uint64_t> unsigned_field_or(std::string_view key, uint64_t max, uint64_t fallback) const;
  // nullopt when the key is absent or null.
  Result<std::optional<uint64_t>> nullable_unsigned_field(std::string_view key, uint64_t max) const;
  Result<std::string> string_field(std::string_view key) const;
  Result<std::string> name_field(std::string_view key) const;
  Result<bool> bool_field_or(std::string_view key, bool fallback) const;
  Result<const Json*> array_field(std::string_view key, size_t max_items) const;

 private:
  const Json& object_;
  std::string path_;
};

}  // namespace kvbridge::json_io

// InstanceRecord to and from JSON (kvbridge/discovery.h, docs/discovery.md).
//
// A record comes from whoever can write to etcd, so parsing treats it as
// outside input: the size is bounded before parsing, nesting is bounded
// (nlohmann's DOM is walked recursively), repeated and unknown fields are
// refused rather than silently resolved, and every error names the field.
#include <nlohmann/json.hpp>

#include <set>
#include <vector>

#include "common/text.h"
#include "kvbridge/discovery.h"
#include "net/session.h"

namespace kvbridge {
namespace {

using Json = nlohmann::json;

// A record nests two levels (the object, then "ranks" or "labels").
constexpr size_t kMaxDepth = 4;
constexpr size_t kMaxAddressBytes = 256;
constexpr size_t kMaxLabelKeyBytes = 63;
constexpr size_t kMaxLabelValueBytes = 256;

Status bad(std::string_view field, const std::string& why) {
  return Status::invalid_argument("instance record field '" + std::string(field) + "': " + why);
}

bool id_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '-';
}

bool printable_ascii(std::string_view s, bool space_ok) {
  for (char c : s) {
    if (c < ' ' || c > '~' || (c == ' ' && !space_ok)) return false;
  }
  return true;
}

std::string shown(std::string_view s) {
  // For messages: at most 64 bytes of what was given, control bytes as '?'.
  std::string out = "'";
  for (char c : s.substr(0, 64)) out += (c >= ' ' && c <= '~') ? c : '?';
  return out + (s.size() > 64 ? "...'" : "'");
}

}  // namespace

Status check_instance_record(const InstanceRecord& r) {
  if (r.id.empty() || r.id.size() > kMaxInstanceIdBytes) {
    return bad("id",
               "must be 1 to " + std::to_string(kMaxInstanceIdBytes) + " bytes, not " + std::to_string(r.id.size()));
  }
  for (char c : r.id) {
    if (!id_char(c)) return bad("id", shown(r.id) + " has a byte outside [A-Za-z0-9._:-]");
  }
  if (r.role != "prefill" && r.role != "decode") return bad("role", shown(r.role) + " is not 'prefill' or 'decode'");
  if (r.ranks.empty() || r.ranks.size() > kMaxInstanceRanks) {
    return bad("ranks", "must list 1 to " + std::to_string(kMaxInstanceRanks) + " addresses, not " +
                            std::to_string(r.ranks.size()));
  }
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const std::string& a = r.ranks[i];
    if (a.empty() || a.size() > kMaxAddressBytes || !printable_ascii(a, false) || a.find(':') == std::string::npos) {
      return bad("ranks[" + std::to_string(i) + "]", shown(a) + " is not host:port (at most 256 bytes)");
    }
  }
  if (r.identity.size() != 16 || r.identity.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return bad("identity", shown(r.identity) + " is not 16 lower-case hex digits");
  }
  if (r.protocol == 0 || r.protocol > 65535) return bad("protocol", std::to_string(r.protocol) + " is not 1 to 65535");
  if (r.labels.size() > kMaxInstanceLabels) {
    return bad("labels", std::to_string(r.labels.size()) + " labels, more than " + std::to_string(kMaxInstanceLabels));
  }
  for (const auto& [k, v] : r.labels) {
    if (k.empty() || k.size() > kMaxLabelKeyBytes ||
        k.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._/-") !=
            std::string::npos) {
      return bad("labels", "key " + shown(k) + " is not 1 to 63 bytes of [A-Za-z0-9._/-]");
    }
    if (v.size() > kMaxLabelValueBytes || !printable_ascii(v, true)) {
      return bad("labels", "the value of " + shown(k) + " is not at most 256 bytes of printable ASCII");
    }
  }
  return Status();
}

namespace {

Json unsigned_json(const InstanceRecord& r) {
  return {{"format", kInstanceRecordFormat},
          {"id", r.id},
          {"role", r.role},
          {"ranks", r.ranks},
          {"identity", r.identity},
          {"protocol", r.protocol},
          {"labels", r.labels}};
}

// HMAC-SHA256 under the secret over the canonical line (keys sorted, no
// "mac"), labelled so that no other MAC of the deployment's secret is one.
std::string record_mac(std::string_view canonical, std::string_view secret) {
  return to_hex(net::view(net::hmac(secret, {"kvbridge.instance/1 record", canonical})));
}

}  // namespace

Result<std::string> instance_record_to_json(const InstanceRecord& r, std::string_view secret) {
  KVB_RETURN_IF_ERROR(check_instance_record(r));
  Json j = unsigned_json(r);
  if (!secret.empty()) j["mac"] = record_mac(j.dump(), secret);
  return j.dump();
}

namespace {

// Rejects nesting deeper than kMaxDepth (common/text.h).
Status check_depth(std::string_view text) {
  if (json_nesting_past(text, kMaxDepth))
    return Status::invalid_argument("instance record nests deeper than a record can");
  return Status();
}

Result<std::string> string_field(const Json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return bad(field, "missing");
  if (!it->is_string()) return bad(field, std::string("is a JSON ") + it->type_name() + ", not a string");
  return it->get<std::string>();
}

}  // namespace

Result<InstanceRecord> parse_instance_record(std::string_view text, std::string_view secret) {
  if (text.size() > kMaxInstanceRecordBytes) {
    return Status::resource_exhausted("instance record of " + std::to_string(text.size()) + " bytes, more than " +
                                      std::to_string(kMaxInstanceRecordBytes));
  }
  KVB_RETURN_IF_ERROR(check_depth(text));
  // Repeated keys: nlohmann keeps the last one silently; a record with two
  // "ranks" could mean either, so it is refused.
  std::vector<std::set<std::string>> keys;
  std::string repeated;
  auto callback = [&](int, Json::parse_event_t event, Json& parsed) {
    using E = Json::parse_event_t;
    if (event == E::object_start) keys.emplace_back();
    if (event == E::object_end && !keys.empty()) keys.pop_back();
    if (event == E::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && repeated.empty()) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  Json j;
  try {
    j = Json::parse(text, callback);
  } catch (const Json::exception& e) {
    return Status::invalid_argument(std::string("instance record is not JSON: ") + e.what());
  }
  if (!repeated.empty()) return bad(repeated, "appears twice");
  if (!j.is_object()) return Status::invalid_argument("instance record is not a JSON object");

  KVB_ASSIGN_OR_RETURN(std::string format, string_field(j, "format"));
  if (format != kInstanceRecordFormat) {
    return Status::incompatible("instance record format " + shown(format) + " is not " +
                                std::string(kInstanceRecordFormat) + ", the one this build reads");
  }
  static const std::set<std::string> kFields = {"format",   "id",       "role",   "ranks",
                                                "identity", "protocol", "labels", "mac"};
  for (const auto& [k, v] : j.items()) {
    if (!kFields.contains(k)) return bad(k, "unknown field");
  }
  InstanceRecord r;
  KVB_ASSIGN_OR_RETURN(r.id, string_field(j, "id"));
  KVB_ASSIGN_OR_RETURN(r.role, string_field(j, "role"));
  KVB_ASSIGN_OR_RETURN(r.identity, string_field(j, "identity"));

  auto ranks = j.find("ranks");
  if (ranks == j.end()) return bad("ranks", "missing");
  if (!ranks->is_array()) return bad("ranks", std::string("is a JSON ") + ranks->type_name() + ", not an array");
  if (ranks->size() > kMaxInstanceRanks) return bad("ranks", "more than " + std::to_string(kMaxInstanceRanks));
  for (size_t i = 0; i < ranks->size(); ++i) {
    if (!(*ranks)[i].is_string()) return bad("ranks[" + std::to_string(i) + "]", "is not a string");
    r.ranks.push_back((*ranks)[i].get<std::string>());
  }

  auto protocol = j.find("protocol");
  if (protocol == j.end()) return bad("protocol", "missing");
  if (!protocol->is_number_unsigned() || protocol->get<uint64_t>() > 65535) {
    return bad("protocol", "is not an integer from 1 to 65535");
  }
  r.protocol = protocol->get<uint32_t>();

  auto labels = j.find("labels");
  if (labels != j.end()) {
    if (!labels->is_object()) return bad("labels", std::string("is a JSON ") + labels->type_name() + ", not an object");
    if (labels->size() > kMaxInstanceLabels) return bad("labels", "more than " + std::to_string(kMaxInstanceLabels));
    for (const auto& [k, v] : labels->items()) {
      if (!v.is_string()) return bad("labels", "the value of " + shown(k) + " is not a string");
      r.labels[k] = v.get<std::string>();
    }
  }
  KVB_RETURN_IF_ERROR(check_instance_record(r));
  auto mac = j.find("mac");
  if (mac != j.end() && !mac->is_string())
    return bad("mac", std::string("is a JSON ") + mac->type_name() + ", not a string");
  if (!secret.empty()) {
    if (mac == j.end()) {
      return Status::permission_denied("instance record " + shown(r.id) +
                                       " is not signed (no 'mac'), and this reader holds the deployment's secret");
    }
    const std::string want = record_mac(unsigned_json(r).dump(), secret);
    if (!net::equal_constant_time(mac->get_ref<const std::string&>(), want)) {
      return Status::permission_denied("instance record " + shown(r.id) +
                                       " is not signed with this deployment's secret (its 'mac' does not match)");
    }
  }
  return r;
}

std::string_view instance_event_name(InstanceEvent event) {
  switch (event) {
    case InstanceEvent::kAdded:
      return "added";
    case InstanceEvent::kRemoved:
      return "removed";
    case InstanceEvent::kChanged:
      return "changed";
  }
  return "?";
}

std::string instance_key(const EtcdOptions& options, std::string_view id) {
  return options.prefix + "/instances/" + std::string(id);
}

}  // namespace kvbridge

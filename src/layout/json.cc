// kvbridge.layout/1: parse_layout() and to_json(const Layout&).
//
// The reader walks the fixed shape of the format (layout, tensors, groups,
// layers, components, heads, axes) and never recurses into values it does not
// expect, so unknown or mistyped input fails at the first wrong field with its
// path. Bounds that protect narrowing (uint32 fields) and memory (list
// lengths) are checked here; every semantic rule is validate()'s, which runs on
// the result.
#include <algorithm>
#include <exception>
#include <new>
#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "layout/json_io.h"
#include "layout/memory_name.h"

namespace kvbridge {
namespace {

using json_io::Json;
using json_io::ObjectReader;
using json_io::OrderedJson;
using json_io::path_error;
using json_io::quote_text;

// At most one block axis, one head axis and kMaxPositionAxes position axes.
constexpr size_t kMaxAxes = 2 + kMaxPositionAxes;

using layout_internal::valid_memory;

Result<Axis> read_axis(const Json& value, const std::string& path) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  KVB_RETURN_IF_ERROR(r.check_fields({"axis", "size", "stride"}));
  Axis axis;
  KVB_ASSIGN_OR_RETURN(std::string name, r.string_field("axis"));
  std::optional<AxisKind> kind = parse_axis_kind(name);
  if (!kind) {
    return path_error(r.child("axis"), "unknown axis " + quote_text(name) + "; expected block, head or position");
  }
  axis.kind = *kind;
  KVB_ASSIGN_OR_RETURN(axis.size, r.unsigned_field("size", UINT64_MAX));
  KVB_ASSIGN_OR_RETURN(axis.stride, r.unsigned_field("stride", UINT64_MAX));
  return axis;
}

Result<HeadMap> read_heads(const Json& value, const std::string& path) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  KVB_RETURN_IF_ERROR(r.check_fields({"total", "first", "count"}));
  HeadMap heads;
  KVB_ASSIGN_OR_RETURN(uint64_t total, r.unsigned_field("total", kMaxHeads));
  KVB_ASSIGN_OR_RETURN(uint64_t first, r.unsigned_field("first", kMaxHeads));
  KVB_ASSIGN_OR_RETURN(uint64_t count, r.unsigned_field("count", kMaxHeads));
  heads.total = static_cast<uint32_t>(total);
  heads.first = static_cast<uint32_t>(first);
  heads.count = static_cast<uint32_t>(count);
  return heads;
}

Result<Component> read_component(const Json& value, const std::string& path) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  Component c;
  KVB_ASSIGN_OR_RETURN(c.name, r.name_field("name"));
  r.set_name(c.name);
  KVB_RETURN_IF_ERROR(r.check_fields({"name", "tensor", "offset", "cell_bytes", "heads", "axes"}));
  KVB_ASSIGN_OR_RETURN(c.tensor, r.name_field("tensor"));
  KVB_ASSIGN_OR_RETURN(c.offset, r.unsigned_field("offset", UINT64_MAX));
  KVB_ASSIGN_OR_RETURN(c.cell_bytes, r.unsigned_field("cell_bytes", kMaxCellBytes));
  // Absent or null: the component is replicated on every rank.
  if (const Json* heads = r.find("heads"); heads != nullptr && !heads->is_null()) {
    KVB_ASSIGN_OR_RETURN(c.heads, read_heads(*heads, r.child("heads")));
  }
  KVB_ASSIGN_OR_RETURN(const Json* axes, r.array_field("axes", kMaxAxes));
  for (size_t i = 0; i < axes->size(); ++i) {
    KVB_ASSIGN_OR_RETURN(Axis axis, read_axis((*axes)[i], json_io::index_path(r.child("axes"), i)));
    c.axes.push_back(axis);
  }
  return c;
}

// A component of a layer the rank does not hold: name, cell_bytes, heads.
Result<Component> read_unheld_component(const Json& value, const std::string& path) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  Component c;
  KVB_ASSIGN_OR_RETURN(c.name, r.name_field("name"));
  r.set_name(c.name);
  KVB_RETURN_IF_ERROR(r.check_fields({"name", "cell_bytes", "heads"}));
  KVB_ASSIGN_OR_RETURN(c.cell_bytes, r.unsigned_field("cell_bytes", kMaxCellBytes));
  if (const Json* heads = r.find("heads"); heads != nullptr && !heads->is_null()) {
    KVB_ASSIGN_OR_RETURN(c.heads, read_heads(*heads, r.child("heads")));
  }
  return c;
}

Result<ContextShard> read_context(const Json& value, const std::string& path) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  KVB_RETURN_IF_ERROR(r.check_fields({"size", "rank", "interleave"}));
  ContextShard cs;
  KVB_ASSIGN_OR_RETURN(uint64_t size, r.unsigned_field("size", kMaxContextShards));
  KVB_ASSIGN_OR_RETURN(uint64_t rank, r.unsigned_field("rank", kMaxContextShards));
  KVB_ASSIGN_OR_RETURN(cs.interleave, r.unsigned_field_or("interleave", kMaxBlockTokens, 1));
  cs.size = static_cast<uint32_t>(size);
  cs.rank = static_cast<uint32_t>(rank);
  return cs;
}

// `v2`: the document is kvbridge.layout/2 or later, where a layer may say
// "held".
Result<Layer> read_layer(const Json& value, const std::string& path, bool v2) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  Layer layer;
  KVB_ASSIGN_OR_RETURN(layer.name, r.name_field("name"));
  r.set_name(layer.name);
  if (v2) {
    KVB_RETURN_IF_ERROR(r.check_fields({"name", "held", "components"}));
    KVB_ASSIGN_OR_RETURN(layer.held, r.bool_field_or("held", true));
  } else {
    KVB_RETURN_IF_ERROR(r.check_fields({"name", "components"}));
  }
  KVB_ASSIGN_OR_RETURN(const Json* components, r.array_field("components", kMaxComponentsPerLayer));
  layer.components.reserve(components->size());
  for (size_t i = 0; i < components->size(); ++i) {
    const std::string where = json_io::index_path(r.child("components"), i);
    KVB_ASSIGN_OR_RETURN(Component c, layer.held ? read_component((*components)[i], where)
                                                 : read_unheld_component((*components)[i], where));
    layer.components.push_back(std::move(c));
  }
  return layer;
}

// `version`: the document's format version (1, 2 or 3); /3 groups may have
// a "context" shard.
Result<Group> read_group(const Json& value, const std::string& path, int version) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  Group g;
  KVB_ASSIGN_OR_RETURN(g.name, r.name_field("name"));
  r.set_name(g.name);
  if (version >= 3) {
    KVB_RETURN_IF_ERROR(r.check_fields({"name", "kind", "block_tokens", "tokens_per_state", "window_tokens",
                                        "prefix_cacheable", "transfer", "num_blocks", "context", "layers"}));
    if (const Json* context = r.find("context"); context != nullptr) {
      KVB_ASSIGN_OR_RETURN(g.context, read_context(*context, r.child("context")));
    }
  } else {
    KVB_RETURN_IF_ERROR(r.check_fields({"name", "kind", "block_tokens", "tokens_per_state", "window_tokens",
                                        "prefix_cacheable", "transfer", "num_blocks", "layers"}));
  }
  KVB_ASSIGN_OR_RETURN(std::string kind, r.string_field("kind"));
  std::optional<GroupKind> parsed_kind = parse_group_kind(kind);
  if (!parsed_kind) {
    return path_error(r.child("kind"),
                      "unknown kind " + quote_text(kind) + "; expected attention, sliding_window, state or scratch");
  }
  g.kind = *parsed_kind;
  KVB_ASSIGN_OR_RETURN(g.block_tokens, r.unsigned_field("block_tokens", kMaxBlockTokens));
  KVB_ASSIGN_OR_RETURN(g.tokens_per_state, r.unsigned_field_or("tokens_per_state", kMaxBlockTokens, 1));
  KVB_ASSIGN_OR_RETURN(g.window_tokens, r.nullable_unsigned_field("window_tokens", UINT64_MAX));
  KVB_ASSIGN_OR_RETURN(g.prefix_cacheable, r.bool_field_or("prefix_cacheable", true));
  KVB_ASSIGN_OR_RETURN(g.transfer, r.bool_field_or("transfer", true));
  KVB_ASSIGN_OR_RETURN(g.num_blocks, r.unsigned_field("num_blocks", kMaxNumBlocks));
  KVB_ASSIGN_OR_RETURN(const Json* layers, r.array_field("layers", kMaxLayersPerGroup));
  g.layers.reserve(layers->size());
  for (size_t i = 0; i < layers->size(); ++i) {
    KVB_ASSIGN_OR_RETURN(Layer layer,
                         read_layer((*layers)[i], json_io::index_path(r.child("layers"), i), version >= 2));
    g.layers.push_back(std::move(layer));
  }
  return g;
}

Result<Tensor> read_tensor(const Json& value, const std::string& path) {
  KVB_RETURN_IF_ERROR(json_io::expect_object(value, path));
  ObjectReader r(value, path);
  Tensor t;
  KVB_ASSIGN_OR_RETURN(t.name, r.name_field("name"));
  r.set_name(t.name);
  KVB_RETURN_IF_ERROR(r.check_fields({"name", "bytes", "memory"}));
  KVB_ASSIGN_OR_RETURN(t.bytes, r.unsigned_field("bytes", kMaxTensorBytes));
  if (const Json* memory = r.find("memory"); memory != nullptr) {
    KVB_ASSIGN_OR_RETURN(t.memory, json_io::read_string(*memory, r.child("memory")));
    if (!valid_memory(t.memory)) {
      return path_error(r.child("memory"),
                        "unknown memory " + quote_text(t.memory) + "; expected \"host\" or \"cuda:N\" (N: 0 to 99999)");
    }
  }
  return t;
}

Result<Layout> read_layout(std::string_view text) {
  KVB_ASSIGN_OR_RETURN(Json doc, json_io::parse_document(text));
  KVB_RETURN_IF_ERROR(json_io::expect_object(doc, ""));
  ObjectReader r(doc, "");
  // The format first: a request or another version fails here, not on its fields.
  KVB_ASSIGN_OR_RETURN(std::string format, r.string_field("format"));
  if (format != kLayoutFormat && format != kLayoutFormatV2 && format != kLayoutFormatV1) {
    return path_error("format", "expected " + quote_text(kLayoutFormat) + " (or " + quote_text(kLayoutFormatV2) +
                                    " or " + quote_text(kLayoutFormatV1) + "), got " + quote_text(format));
  }
  const int version = format == kLayoutFormat ? 3 : format == kLayoutFormatV2 ? 2 : 1;
  const bool v2 = version >= 2;
  if (v2) {
    KVB_RETURN_IF_ERROR(
        r.check_fields({"format", "model", "dtype", "tp_size", "tp_rank", "pp_size", "pp_rank", "tensors", "groups"}));
  } else {
    KVB_RETURN_IF_ERROR(r.check_fields({"format", "model", "dtype", "tp_size", "tp_rank", "tensors", "groups"}));
  }
  Layout layout;
  KVB_ASSIGN_OR_RETURN(layout.model, r.name_field("model"));
  KVB_ASSIGN_OR_RETURN(layout.dtype, r.name_field("dtype"));
  KVB_ASSIGN_OR_RETURN(uint64_t tp_size, r.unsigned_field("tp_size", kMaxTpSize));
  KVB_ASSIGN_OR_RETURN(uint64_t tp_rank, r.unsigned_field("tp_rank", kMaxTpSize - 1));
  layout.tp_size = static_cast<uint32_t>(tp_size);
  layout.tp_rank = static_cast<uint32_t>(tp_rank);
  if (v2) {
    KVB_ASSIGN_OR_RETURN(uint64_t pp_size, r.unsigned_field_or("pp_size", kMaxPpSize, 1));
    KVB_ASSIGN_OR_RETURN(uint64_t pp_rank, r.unsigned_field_or("pp_rank", kMaxPpSize - 1, 0));
    layout.pp_size = static_cast<uint32_t>(pp_size);
    layout.pp_rank = static_cast<uint32_t>(pp_rank);
  }
  KVB_ASSIGN_OR_RETURN(const Json* tensors, r.array_field("tensors", kMaxTensors));
  layout.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    KVB_ASSIGN_OR_RETURN(Tensor t, read_tensor((*tensors)[i], json_io::index_path("tensors", i)));
    layout.tensors.push_back(std::move(t));
  }
  KVB_ASSIGN_OR_RETURN(const Json* groups, r.array_field("groups", kMaxGroups));
  layout.groups.reserve(groups->size());
  for (size_t i = 0; i < groups->size(); ++i) {
    KVB_ASSIGN_OR_RETURN(Group g, read_group((*groups)[i], json_io::index_path("groups", i), version));
    layout.groups.push_back(std::move(g));
  }
  KVB_RETURN_IF_ERROR(validate(layout));
  return layout;
}

OrderedJson component_json(const Component& c, bool held) {
  OrderedJson j;
  j["name"] = c.name;
  if (held) {
    j["tensor"] = c.tensor;
    j["offset"] = c.offset;
  }
  j["cell_bytes"] = c.cell_bytes;
  if (c.heads) j["heads"] = {{"total", c.heads->total}, {"first", c.heads->first}, {"count", c.heads->count}};
  if (!held) return j;
  j["axes"] = OrderedJson::array();
  for (const Axis& a : c.axes) {
    j["axes"].push_back({{"axis", axis_kind_name(a.kind)}, {"size", a.size}, {"stride", a.stride}});
  }
  return j;
}

OrderedJson group_json(const Group& g) {
  OrderedJson j;
  j["name"] = g.name;
  j["kind"] = group_kind_name(g.kind);
  j["block_tokens"] = g.block_tokens;
  j["tokens_per_state"] = g.tokens_per_state;
  j["window_tokens"] = g.window_tokens ? OrderedJson(*g.window_tokens) : OrderedJson(nullptr);
  j["prefix_cacheable"] = g.prefix_cacheable;
  j["transfer"] = g.transfer;
  j["num_blocks"] = g.num_blocks;
  if (g.context.sharded()) {
    j["context"] = {{"size", g.context.size}, {"rank", g.context.rank}, {"interleave", g.context.interleave}};
  }
  j["layers"] = OrderedJson::array();
  for (const Layer& l : g.layers) {
    OrderedJson layer;
    layer["name"] = l.name;
    if (!l.held) layer["held"] = false;
    layer["components"] = OrderedJson::array();
    for (const Component& c : l.components) layer["components"].push_back(component_json(c, l.held));
    j["layers"].push_back(std::move(layer));
  }
  return j;
}

}  // namespace

Result<Layout> parse_layout(std::string_view json) {
  return json_io::guarded<Layout>("layout", [&] { return read_layout(json); });
}

std::string to_json(const Layout& layout, int indent) {
  OrderedJson j;
  // The oldest version that holds the layout, so that older readers keep
  // reading it: /3 for a context shard, /2 for PP stages, else /1.
  const bool v3 =
      std::any_of(layout.groups.begin(), layout.groups.end(), [](const Group& g) { return g.context.sharded(); });
  const bool v2 = v3 || layout.pp_size != 1;
  j["format"] = v3 ? kLayoutFormat : v2 ? kLayoutFormatV2 : kLayoutFormatV1;
  j["model"] = layout.model;
  j["dtype"] = layout.dtype;
  j["tp_size"] = layout.tp_size;
  j["tp_rank"] = layout.tp_rank;
  if (v2) {
    j["pp_size"] = layout.pp_size;
    j["pp_rank"] = layout.pp_rank;
  }
  j["tensors"] = OrderedJson::array();
  for (const Tensor& t : layout.tensors) {
    j["tensors"].push_back({{"name", t.name}, {"bytes", t.bytes}, {"memory", t.memory}});
  }
  j["groups"] = OrderedJson::array();
  for (const Group& g : layout.groups) j["groups"].push_back(group_json(g));
  return json_io::write(j, indent);
}

}  // namespace kvbridge

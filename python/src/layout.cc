// Layouts, requests and presets: layout.h, layout_json.h, presets.h.
//
// The layout model is bound as plain value classes. Enumerations (group kind,
// axis kind) are their JSON strings, so a Layout reads the same in Python as
// in its `kvbridge.layout/1` JSON. Nested lists are returned as copies
// (pybind11 converts std::vector to list): assign a modified list back.
#include <pybind11/stl.h>

#include <fstream>
#include <sstream>

#include "bindings.h"
#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/presets.h"

namespace kvbridge::python {
namespace {

Layout layout_from_json(const std::string& text) { return unwrap(parse_layout(text)); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_status(Status::io_error("cannot open '" + path + "' for reading"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) throw_status(Status::io_error("cannot write '" + path + "'"));
}

GroupKind group_kind_of(const std::string& s) {
  auto k = parse_group_kind(s);
  if (!k)
    throw_status(
        Status::invalid_argument("unknown group kind '" + s + "' (attention, sliding_window, state, scratch)"));
  return *k;
}

AxisKind axis_kind_of(const std::string& s) {
  auto k = parse_axis_kind(s);
  if (!k) throw_status(Status::invalid_argument("unknown axis '" + s + "' (block, head, position)"));
  return *k;
}

// blocks: {group: GroupBlocks | (local, remote) | {"local": [...], "remote": [...]}}
std::map<std::string, GroupBlocks> blocks_of(const py::dict& blocks) {
  std::map<std::string, GroupBlocks> out;
  for (auto item : blocks) {
    const std::string name = py::str(item.first);
    py::handle v = item.second;
    GroupBlocks g;
    if (py::isinstance<GroupBlocks>(v)) {
      g = v.cast<GroupBlocks>();
    } else if (py::isinstance<py::dict>(v)) {
      py::dict d = py::reinterpret_borrow<py::dict>(v);
      if (d.contains("local")) g.local = d["local"].cast<std::vector<int64_t>>();
      if (d.contains("remote")) g.remote = d["remote"].cast<std::vector<int64_t>>();
    } else {
      py::sequence s = v.cast<py::sequence>();
      if (s.size() != 2) {
        throw_status(Status::invalid_argument("blocks of group '" + name + "': expected (local, remote) lists"));
      }
      g.local = s[0].cast<std::vector<int64_t>>();
      g.remote = s[1].cast<std::vector<int64_t>>();
    }
    out.emplace(name, std::move(g));
  }
  return out;
}

std::string layout_repr(const Layout& l) {
  std::string groups;
  for (const Group& g : l.groups) {
    if (!groups.empty()) groups += ", ";
    groups += g.name + "(" + std::string(group_kind_name(g.kind)) + ", " + std::to_string(g.layers.size()) + " layers)";
  }
  return "<kvbridge.Layout model='" + l.model + "' dtype='" + l.dtype + "' tp_rank=" + std::to_string(l.tp_rank) + "/" +
         std::to_string(l.tp_size) + " tensors=" + std::to_string(l.tensors.size()) + " groups=[" + groups + "]>";
}

void bind_model(py::module_& m) {
  py::class_<Tensor>(m, "Tensor", "One contiguous allocation of KV memory: the unit registered with a transport.")
      .def(py::init([](std::string name, uint64_t bytes, std::string memory) {
             return Tensor{std::move(name), bytes, std::move(memory)};
           }),
           py::arg("name"), py::arg("bytes"), py::arg("memory") = "host")
      .def_readwrite("name", &Tensor::name)
      .def_readwrite("bytes", &Tensor::bytes)
      .def_readwrite("memory", &Tensor::memory, "'host' or 'cuda:N'")
      .def("__eq__", [](const Tensor& a, const Tensor& b) { return a == b; })
      .def("__repr__", [](const Tensor& t) {
        return "Tensor(name='" + t.name + "', bytes=" + std::to_string(t.bytes) + ", memory='" + t.memory + "')";
      });

  py::class_<Axis>(m, "Axis", "One strided axis of a component: kind 'block', 'head' or 'position'; stride in bytes.")
      .def(py::init([](const std::string& kind, uint64_t size, uint64_t stride) {
             return Axis{axis_kind_of(kind), size, stride};
           }),
           py::arg("kind"), py::arg("size"), py::arg("stride"))
      .def_property(
          "kind", [](const Axis& a) { return std::string(axis_kind_name(a.kind)); },
          [](Axis& a, const std::string& k) { a.kind = axis_kind_of(k); })
      .def_readwrite("size", &Axis::size)
      .def_readwrite("stride", &Axis::stride, "bytes between consecutive indices")
      .def("__eq__", [](const Axis& a, const Axis& b) { return a == b; })
      .def("__repr__", [](const Axis& a) {
        return "Axis('" + std::string(axis_kind_name(a.kind)) + "', size=" + std::to_string(a.size) +
               ", stride=" + std::to_string(a.stride) + ")";
      });

  py::class_<HeadMap>(m, "HeadMap", "Local head h of a component is global head first + h; count heads are held.")
      .def(py::init([](uint32_t total, uint32_t first, uint32_t count) {
             return HeadMap{total, first, count};
           }),
           py::arg("total"), py::arg("first"), py::arg("count"))
      .def_readwrite("total", &HeadMap::total)
      .def_readwrite("first", &HeadMap::first)
      .def_readwrite("count", &HeadMap::count)
      .def("__eq__", [](const HeadMap& a, const HeadMap& b) { return a == b; })
      .def("__repr__", [](const HeadMap& h) {
        return "HeadMap(total=" + std::to_string(h.total) + ", first=" + std::to_string(h.first) +
               ", count=" + std::to_string(h.count) + ")";
      });

  py::class_<ContextShard>(m, "ContextShard",
                           "A group's positions dealt over `size` shards in chunks of `interleave` positions;\n"
                           "this rank holds shard `rank` (docs/formats/layout.md, 'Context shards').")
      .def(py::init([](uint32_t size, uint32_t rank, uint64_t interleave) {
             return ContextShard{size, rank, interleave};
           }),
           py::arg("size") = 1, py::arg("rank") = 0, py::arg("interleave") = 1)
      .def_readwrite("size", &ContextShard::size)
      .def_readwrite("rank", &ContextShard::rank)
      .def_readwrite("interleave", &ContextShard::interleave)
      .def("sharded", &ContextShard::sharded)
      .def("shard_of", &ContextShard::shard_of, py::arg("position"), "The shard holding a position.")
      .def("holds", &ContextShard::holds, py::arg("position"))
      .def("local_of", &ContextShard::local_of, py::arg("position"), "A position's number on the shard that holds it.")
      .def("global_of", &ContextShard::global_of, py::arg("local"),
           "The position that is number `local` of this rank's shard.")
      .def("count", &ContextShard::count, py::arg("positions"), py::arg("shard"),
           "How many of positions [0, positions) shard `shard` holds.")
      .def("__eq__", [](const ContextShard& a, const ContextShard& b) { return a == b; })
      .def("__repr__", [](const ContextShard& c) {
        return "ContextShard(size=" + std::to_string(c.size) + ", rank=" + std::to_string(c.rank) +
               ", interleave=" + std::to_string(c.interleave) + ")";
      });

  py::class_<Component>(m, "Component",
                        "One array of a layer (k, v, latent, rope, ...) as a strided view into one tensor:\n"
                        "cell (block, head, position) is at tensor.base + offset + sum(index * stride).")
      .def(py::init([](std::string name, std::string tensor, uint64_t offset, uint64_t cell_bytes,
                       std::vector<Axis> axes, std::optional<HeadMap> heads) {
             Component c;
             c.name = std::move(name);
             c.tensor = std::move(tensor);
             c.offset = offset;
             c.cell_bytes = cell_bytes;
             c.axes = std::move(axes);
             c.heads = heads;
             return c;
           }),
           py::arg("name"), py::arg("tensor"), py::arg("offset"), py::arg("cell_bytes"), py::arg("axes"),
           py::arg("heads") = py::none())
      .def_readwrite("name", &Component::name)
      .def_readwrite("tensor", &Component::tensor)
      .def_readwrite("offset", &Component::offset)
      .def_readwrite("cell_bytes", &Component::cell_bytes)
      .def_readwrite("heads", &Component::heads, "HeadMap, or None for a component replicated on every rank")
      .def_readwrite("axes", &Component::axes, "list of Axis (a copy: assign a modified list back)")
      .def("positions_per_block", &Component::positions_per_block)
      .def("__eq__", [](const Component& a, const Component& b) { return a == b; })
      .def("__repr__", [](const Component& c) {
        return "<kvbridge.Component '" + c.name + "' tensor='" + c.tensor + "' offset=" + std::to_string(c.offset) +
               " cell_bytes=" + std::to_string(c.cell_bytes) + ">";
      });

  py::class_<Layer>(m, "Layer", "A named layer and its components.")
      .def(py::init([](std::string name, std::vector<Component> components) {
             return Layer{std::move(name), std::move(components)};
           }),
           py::arg("name"), py::arg("components"))
      .def_readwrite("name", &Layer::name)
      .def_readwrite("components", &Layer::components)
      .def_readwrite("held", &Layer::held,
                     "False for a layer of another pipeline stage: its components carry identity only")
      .def("__eq__", [](const Layer& a, const Layer& b) { return a == b; })
      .def("__repr__", [](const Layer& l) {
        return "<kvbridge.Layer '" + l.name + "' components=" + std::to_string(l.components.size()) + ">";
      });

  py::class_<Group>(m, "Group",
                    "Layers that share one block table; kind is 'attention', 'sliding_window', 'state' or "
                    "'scratch'.")
      .def(py::init([](std::string name, const std::string& kind, uint64_t block_tokens, uint64_t num_blocks,
                       std::vector<Layer> layers, uint64_t tokens_per_state, std::optional<uint64_t> window_tokens,
                       bool prefix_cacheable, bool transfer) {
             Group g;
             g.name = std::move(name);
             g.kind = group_kind_of(kind);
             g.block_tokens = block_tokens;
             g.num_blocks = num_blocks;
             g.layers = std::move(layers);
             g.tokens_per_state = tokens_per_state;
             g.window_tokens = window_tokens;
             g.prefix_cacheable = prefix_cacheable;
             g.transfer = transfer;
             return g;
           }),
           py::arg("name"), py::arg("kind"), py::arg("block_tokens"), py::arg("num_blocks"), py::arg("layers"),
           py::arg("tokens_per_state") = 1, py::arg("window_tokens") = py::none(), py::arg("prefix_cacheable") = true,
           py::arg("transfer") = true)
      .def_readwrite("name", &Group::name)
      .def_property(
          "kind", [](const Group& g) { return std::string(group_kind_name(g.kind)); },
          [](Group& g, const std::string& k) { g.kind = group_kind_of(k); })
      .def_readwrite("block_tokens", &Group::block_tokens)
      .def_readwrite("tokens_per_state", &Group::tokens_per_state)
      .def_readwrite("window_tokens", &Group::window_tokens)
      .def_readwrite("prefix_cacheable", &Group::prefix_cacheable)
      .def_readwrite("transfer", &Group::transfer)
      .def_readwrite("num_blocks", &Group::num_blocks)
      .def_readwrite("layers", &Group::layers)
      .def_readwrite("context", &Group::context, "ContextShard: the share of the positions this rank holds")
      .def("positions_per_block", &Group::positions_per_block)
      .def("entries_for_tokens", &Group::entries_for_tokens, py::arg("num_tokens"),
           "List entries holding tokens [0, num_tokens) (a sharded group's: shard 0's)")
      .def("__eq__", [](const Group& a, const Group& b) { return a == b; })
      .def("__repr__", [](const Group& g) {
        return "<kvbridge.Group '" + g.name + "' kind=" + std::string(group_kind_name(g.kind)) +
               " block_tokens=" + std::to_string(g.block_tokens) + " num_blocks=" + std::to_string(g.num_blocks) +
               " layers=" + std::to_string(g.layers.size()) + ">";
      });
}

void bind_layout_class(py::module_& m) {
  py::class_<Layout>(m, "Layout",
                     "How one rank's KV cache sits in memory (`kvbridge.layout/3`, docs/formats/layout.md).\n\n"
                     "Build one with Layout.from_json / Layout.load, make_preset(), or\n"
                     "layout_from_tensors() from an engine's own torch tensors. Layouts from those are\n"
                     "valid; one edited field by field is checked by validate().\n\n"
                     "Two ranks can exchange KV exactly when their identities (identity_text()) are\n"
                     "equal; check_compatible() raises Incompatible naming the first field that differs.")
      .def(py::init([](std::string model, std::string dtype, uint32_t tp_size, uint32_t tp_rank,
                       std::vector<Tensor> tensors, std::vector<Group> groups) {
             Layout l;
             l.model = std::move(model);
             l.dtype = std::move(dtype);
             l.tp_size = tp_size;
             l.tp_rank = tp_rank;
             l.tensors = std::move(tensors);
             l.groups = std::move(groups);
             return l;
           }),
           py::arg("model"), py::arg("dtype"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
           py::arg("tensors") = std::vector<Tensor>{}, py::arg("groups") = std::vector<Group>{},
           "Builds a layout field by field (not validated: call validate()).")
      .def_static(
          "from_json", &layout_from_json, py::arg("text"),
          "Parses and validates `kvbridge.layout` JSON (/1, /2 or /3). Raises InvalidArgument naming the JSON path,\n"
          "OutOfRange or ResourceExhausted naming the group, layer and component at fault.")
      .def_static(
          "load", [](const std::string& path) { return layout_from_json(read_file(path)); }, py::arg("path"),
          "Reads and validates a layout JSON file. Raises IoError when the file cannot be read.")
      .def(
          "to_json", [](const Layout& l, int indent) { return to_json(l, indent); }, py::arg("indent") = 2,
          "The layout as JSON; indent < 0 writes one line.")
      .def(
          "save",
          [](const Layout& l, const std::string& path, int indent) { write_file(path, to_json(l, indent) + "\n"); },
          py::arg("path"), py::arg("indent") = 2, "Writes the layout as JSON to `path`.")
      .def(
          "to_dict", [](const Layout& l) { return py::module_::import("json").attr("loads")(to_json(l, -1)); },
          "The layout as a dict of its JSON form.")
      .def_static(
          "from_dict",
          [](const py::dict& d) {
            return layout_from_json(py::module_::import("json").attr("dumps")(d).cast<std::string>());
          },
          py::arg("d"), "Parses and validates a dict of the JSON form.")
      .def(
          "validate", [](const Layout& l) { check(validate(l)); },
          "Checks every rule of docs/formats/layout.md; raises InvalidArgument, OutOfRange or\n"
          "ResourceExhausted naming the group, layer and component at fault.")
      .def("identity_text", &identity_text, "The canonical text of what must match between peers.")
      .def_property_readonly("compatibility_hash", &compatibility_hash,
                             "XXH3-64 of identity_text(): equal identities, equal hashes on any machine.")
      .def_property_readonly("compatibility_hash_hex", &compatibility_hash_hex, "compatibility_hash as 16 hex digits.")
      .def(
          "check_compatible", [](const Layout& local, const Layout& remote) { check(check_compatible(local, remote)); },
          py::arg("remote"),
          "Returns None when the two layouts can exchange KV; raises Incompatible naming the first\n"
          "differing field and both values, e.g. \"group 'full' layer 'layers.0' component 'k': cell_bytes\n"
          "differs: 256 vs 128\".")
      .def(
          "is_compatible",
          [](const Layout& local, const Layout& remote) { return check_compatible(local, remote).ok(); },
          py::arg("remote"), "True when check_compatible() would not raise.")
      .def(
          "find_tensor",
          [](const Layout& l, const std::string& name) -> std::optional<Tensor> {
            const Tensor* t = l.find_tensor(name);
            return t ? std::optional<Tensor>(*t) : std::nullopt;
          },
          py::arg("name"), "A copy of the named tensor, or None.")
      .def(
          "find_group",
          [](const Layout& l, const std::string& name) -> std::optional<Group> {
            const Group* g = l.find_group(name);
            return g ? std::optional<Group>(*g) : std::nullopt;
          },
          py::arg("name"), "A copy of the named group, or None.")
      .def_property_readonly(
          "tensor_names",
          [](const Layout& l) {
            std::vector<std::string> out;
            for (const Tensor& t : l.tensors) out.push_back(t.name);
            return out;
          },
          "Names of the tensors, in layout order (the order memory is passed in).")
      .def_readwrite("model", &Layout::model)
      .def_readwrite("dtype", &Layout::dtype)
      .def_readwrite("tp_size", &Layout::tp_size)
      .def_readwrite("tp_rank", &Layout::tp_rank)
      .def_readwrite("pp_size", &Layout::pp_size)
      .def_readwrite("pp_rank", &Layout::pp_rank)
      .def_property_readonly("rank", &Layout::rank, "pp_rank * tp_size + tp_rank: the rank in its instance")
      .def_readwrite("tensors", &Layout::tensors, "list of Tensor (a copy: assign a modified list back)")
      .def_readwrite("groups", &Layout::groups, "list of Group (a copy: assign a modified list back)")
      .def("__eq__", [](const Layout& a, const Layout& b) { return a == b; })
      .def("__repr__", &layout_repr)
      .def(py::pickle([](const Layout& l) { return to_json(l, -1); },
                      [](const std::string& s) { return layout_from_json(s); }));

  m.def(
      "compare_identity_text",
      [](const std::string& local, const std::string& remote) { check(compare_identity_text(local, remote)); },
      py::arg("local"), py::arg("remote"),
      "Raises Incompatible naming the first differing field of two identity_text() outputs.");
}

void bind_request(py::module_& m) {
  py::class_<GroupBlocks>(m, "GroupBlocks",
                          "A group's block ids on each side, in request order (-1: a block that moves nothing).")
      .def(py::init([](std::vector<int64_t> local, std::vector<int64_t> remote) {
             return GroupBlocks{std::move(local), std::move(remote)};
           }),
           py::arg("local") = std::vector<int64_t>{}, py::arg("remote") = std::vector<int64_t>{})
      .def_readwrite("local", &GroupBlocks::local)
      .def_readwrite("remote", &GroupBlocks::remote)
      .def("__eq__", [](const GroupBlocks& a, const GroupBlocks& b) { return a == b; })
      .def("__repr__", [](const GroupBlocks& g) {
        return "GroupBlocks(local=" + std::string(py::repr(py::cast(g.local))) +
               ", remote=" + std::string(py::repr(py::cast(g.remote))) + ")";
      });

  py::class_<Request>(m, "Request",
                      "What one request transfers (`kvbridge.request/1`): num_tokens, skip_tokens (leading tokens\n"
                      "the receiver already has), and per group the block ids on each side.\n\n"
                      "    Request(48, {'full': ([3, 4, 5], [10, 11, 12])})")
      .def(py::init([](uint64_t num_tokens, const py::dict& blocks, uint64_t skip_tokens) {
             Request r;
             r.num_tokens = num_tokens;
             r.skip_tokens = skip_tokens;
             r.blocks = blocks_of(blocks);
             return r;
           }),
           py::arg("num_tokens") = 0, py::arg("blocks") = py::dict(), py::arg("skip_tokens") = 0,
           "blocks: {group: (local_ids, remote_ids)} or {group: GroupBlocks} or\n"
           "{group: {'local': [...], 'remote': [...]}}.")
      .def_static(
          "from_json", [](const std::string& text) { return unwrap(parse_request(text)); }, py::arg("text"),
          "Parses `kvbridge.request/1` JSON (structure only; the planner checks it against layouts).")
      .def(
          "to_json", [](const Request& r, int indent) { return to_json(r, indent); }, py::arg("indent") = 2)
      .def_readwrite("num_tokens", &Request::num_tokens)
      .def_readwrite("skip_tokens", &Request::skip_tokens)
      .def_property(
          "blocks", [](const Request& r) { return r.blocks; },
          [](Request& r, const py::dict& d) { r.blocks = blocks_of(d); }, "dict of group name -> GroupBlocks (a copy)")
      .def("__eq__", [](const Request& a, const Request& b) { return a == b; })
      .def("__repr__", [](const Request& r) { return "kvbridge.Request.from_json('" + to_json(r, -1) + "')"; })
      .def(py::pickle([](const Request& r) { return to_json(r, -1); },
                      [](const std::string& s) { return unwrap(parse_request(s)); }));
}

void bind_presets(py::module_& m) {
  m.def("preset_names", &preset_names, "Names of every preset layout, in a stable order.");
  m.def(
      "preset_summary", [](const std::string& name) { return preset_summary(name); }, py::arg("name"),
      "One line describing a preset ('' if unknown).");
  m.def(
      "make_preset",
      [](const std::string& name, uint32_t tp_size, uint32_t tp_rank, uint64_t block_tokens,
         uint64_t kernel_block_tokens, const std::string& order, uint64_t num_blocks, uint32_t spec_tokens,
         uint32_t pp_size, uint32_t pp_rank, uint32_t dcp_size, uint64_t dcp_interleave, uint64_t state_blocks) {
        PresetOptions o;
        o.name = name;
        o.tp_size = tp_size;
        o.tp_rank = tp_rank;
        o.block_tokens = block_tokens;
        o.kernel_block_tokens = kernel_block_tokens;
        o.order = unwrap(parse_order(order));
        o.num_blocks = num_blocks;
        o.spec_tokens = spec_tokens;
        o.pp_size = pp_size;
        o.pp_rank = pp_rank;
        o.dcp_size = dcp_size;
        o.dcp_interleave = dcp_interleave;
        o.state_blocks = state_blocks;
        return unwrap(make_preset(o));
      },
      py::arg("name"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0, py::arg("block_tokens") = 0,
      py::arg("kernel_block_tokens") = 0, py::arg("order") = "LBHNC", py::arg("num_blocks") = 0,
      py::arg("spec_tokens") = 0, py::arg("pp_size") = 1, py::arg("pp_rank") = 0, py::arg("dcp_size") = 1,
      py::arg("dcp_interleave") = 1, py::arg("state_blocks") = 0,
      "The layout of rank tp_rank (of pipeline stage pp_rank of pp_size) of an instance of a public\n"
      "architecture (docs/presets.md); dcp_size > 1 deals attention tokens over groups of that many\n"
      "TP ranks (decode context parallelism), in chunks of dcp_interleave tokens.\n"
      "state_blocks sizes the state and scratch tensors no attention group uses (a pool of per-request\n"
      "slots, as SGLang's mamba pool; qwen3-next's) apart from num_blocks.\n"
      "0 takes the preset's default; order is 'LBHNC', 'LBNHC' or 'BLHNC'. Raises NotFound for an\n"
      "unknown name, InvalidArgument naming the option the architecture cannot take.");
}

}  // namespace

void bind_layout(py::module_& m) {
  bind_model(m);
  bind_layout_class(m);
  bind_request(m);
  bind_presets(m);
}

}  // namespace kvbridge::python

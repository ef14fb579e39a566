// Plans, the verifier and deterministic content: plan.h, verify.h, content.h.
//
// A Plan's descriptors are handed to Python as a read-only numpy structured
// array over the plan's own std::vector<Descriptor> (32 bytes each): no copy,
// and the array's base is the Plan object, so the plan lives while any view
// of it does. Plans are immutable from Python, so the vector never moves.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <map>

#include "bindings.h"
#include "kvbridge/content.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"

namespace kvbridge::python {
namespace {

RequestSide side_of(const std::string& s) {
  if (s == "local") return RequestSide::kLocal;
  if (s == "remote") return RequestSide::kRemote;
  throw_status(Status::invalid_argument("side must be 'local' or 'remote', not '" + s + "'"));
}

std::vector<std::span<uint8_t>> spans_of(const Layout& layout, py::handle tensors, bool writable) {
  std::vector<std::string> names;
  for (const Tensor& t : layout.tensors) names.push_back(t.name);
  std::vector<std::span<uint8_t>> out;
  for (const Memory& mem : memories_of(tensors, names, writable)) {
    if (mem.memory != "host") {
      throw_status(Status::invalid_argument("content functions read host memory only, not " + mem.memory));
    }
    out.emplace_back(mem.data, mem.bytes);
  }
  return out;
}

py::array descriptors_view(py::object self) {
  const Plan& p = self.cast<const Plan&>();
  py::array a(py::dtype::of<Descriptor>(), {static_cast<py::ssize_t>(p.descriptors.size())},
              {static_cast<py::ssize_t>(sizeof(Descriptor))}, p.descriptors.data(), self);
  // Read-only: the plan is a checked artefact; a caller who wants to edit
  // takes a copy (np.array(plan.descriptors)).
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

}  // namespace

void bind_plan(py::module_& m) {
  PYBIND11_NUMPY_DTYPE(Descriptor, source, local_tensor, remote_tensor, reserved, local_offset, remote_offset, bytes);
  m.attr("descriptor_dtype") = py::dtype::of<Descriptor>();

  py::class_<SourceTotals>(m, "SourceTotals", "What a plan reads from one remote rank.")
      .def_readonly("tp_rank", &SourceTotals::tp_rank)
      .def_readonly("descriptors", &SourceTotals::descriptors)
      .def_readonly("bytes", &SourceTotals::bytes)
      .def("__repr__", [](const SourceTotals& s) {
        return "SourceTotals(tp_rank=" + std::to_string(s.tp_rank) + ", descriptors=" + std::to_string(s.descriptors) +
               ", bytes=" + std::to_string(s.bytes) + ")";
      });

  py::class_<Plan>(m, "Plan",
                   "The descriptors that move one request's KV from a remote instance's ranks into one\n"
                   "local rank: exact, in bounds, minimal and deterministic (plan.h).\n\n"
                   "plan.descriptors is a read-only numpy structured array (kvbridge.descriptor_dtype:\n"
                   "source, local_tensor, remote_tensor, reserved as uint16; local_offset, remote_offset,\n"
                   "bytes as uint64) viewing the plan's own memory; the Plan stays alive while a view does.")
      .def_property_readonly("descriptors", &descriptors_view, "Zero-copy numpy view of the descriptors.")
      .def_readonly("sources", &Plan::sources, "One SourceTotals per remote layout, in the order given to plan().")
      .def_readonly("bytes", &Plan::bytes, "Sum of the descriptors' bytes.")
      .def("__len__", [](const Plan& p) { return p.descriptors.size(); })
      .def(
          "transfer_items",
          [](const Plan& p, uint16_t source, const std::vector<uint32_t>& local_regions,
             const std::vector<uint32_t>& remote_regions) {
            std::vector<const Descriptor*> ds;
            for (const Descriptor& d : p.descriptors) {
              if (d.source != source) continue;
              if (d.local_tensor >= local_regions.size() || d.remote_tensor >= remote_regions.size()) {
                throw_status(Status::out_of_range("a descriptor names tensor " + std::to_string(d.local_tensor) + "/" +
                                                  std::to_string(d.remote_tensor) + " but " +
                                                  std::to_string(local_regions.size()) + "/" +
                                                  std::to_string(remote_regions.size()) + " regions were given"));
              }
              ds.push_back(&d);
            }
            py::array_t<uint64_t> out({static_cast<py::ssize_t>(ds.size()), py::ssize_t{5}});
            auto w = out.mutable_unchecked<2>();
            for (size_t i = 0; i < ds.size(); ++i) {
              w(i, 0) = local_regions[ds[i]->local_tensor];
              w(i, 1) = ds[i]->local_offset;
              w(i, 2) = remote_regions[ds[i]->remote_tensor];
              w(i, 3) = ds[i]->remote_offset;
              w(i, 4) = ds[i]->bytes;
            }
            return out;
          },
          py::arg("source"), py::arg("local_regions"), py::arg("remote_regions"),
          "The descriptors read from remote layout `source` as an (N, 5) uint64 array of Engine.submit\n"
          "items (local region, local offset, remote region, remote offset, bytes), given the region id\n"
          "of each local tensor and of each of that remote rank's tensors (layout order).")
      .def(
          "to_json",
          [](const Plan& p, const Layout& local, const std::vector<Layout>& remotes, bool items, int verified,
             int indent) { return plan_to_json(p, local, remotes, items, verified, indent); },
          py::arg("local"), py::arg("remotes"), py::arg("items") = false, py::arg("verified") = -1,
          py::arg("indent") = 2, "`kvbridge.plan/1` JSON (docs/formats/plan.md).")
      .def("__repr__", [](const Plan& p) {
        return "<kvbridge.Plan descriptors=" + std::to_string(p.descriptors.size()) +
               " bytes=" + std::to_string(p.bytes) + " sources=" + std::to_string(p.sources.size()) + ">";
      });

  m.def(
      "plan",
      [](const Layout& local, const std::vector<Layout>& remotes, const Request& request) {
        Result<Plan> r = [&] {
          py::gil_scoped_release nogil;
          return plan(local, remotes, request);
        }();
        return unwrap(std::move(r));
      },
      py::arg("local"), py::arg("remotes"), py::arg("request"),
      "Plans `request` into `local` from the ranks in `remotes` (one instance, any subset that holds\n"
      "every needed head). Raises Incompatible (identity, naming the field), InvalidArgument,\n"
      "OutOfRange or ResourceExhausted naming the field; never returns a partial plan.");
  m.def(
      "source_ranks",
      [](const Layout& local, const std::vector<Layout>& remotes) { return unwrap(source_ranks(local, remotes)); },
      py::arg("local"), py::arg("remotes"),
      "The tp_ranks of `remotes` that plans into `local` read from: the fewest that hold everything\n"
      "it moves (docs/planner.md, \"Sources\"), ascending. Raises plan()'s errors for the layouts.");
  m.def(
      "readers_per_source",
      [](const std::vector<Layout>& locals, const std::vector<Layout>& remotes) {
        std::map<uint32_t, std::vector<uint32_t>> out;
        for (SourceReaders& s : unwrap(readers_per_source(locals, remotes))) out[s.rank] = std::move(s.readers);
        return out;
      },
      py::arg("locals"), py::arg("remotes"),
      "For a pair of instances: {remote tp_rank: [local tp_ranks reading it]} (an empty list for a\n"
      "rank nobody reads): how many readers a prefill rank waits for before it frees a request.");
  m.def(
      "layer_order", [](const Layout& layout) { return layer_order(layout); }, py::arg("layout"),
      "The model's layer order: every layer name once, by the number it ends with, then by name\n"
      "(the names save_layer() and wait_for_layer() take).");
  m.def(
      "naive_descriptor_count",
      [](const Layout& local, const std::vector<Layout>& remotes, const Request& request) {
        return naive_descriptor_count(local, remotes, request);
      },
      py::arg("local"), py::arg("remotes"), py::arg("request"),
      "Descriptors the usual per-(layer, component, block) scheme would post, for comparison.");

  py::class_<VerifyReport>(m, "VerifyReport", "What verify() checked.")
      .def_readonly("cells_checked", &VerifyReport::cells_checked)
      .def_readonly("bytes_checked", &VerifyReport::bytes_checked)
      .def_readonly("bytes_written", &VerifyReport::bytes_written)
      .def("__repr__", [](const VerifyReport& r) {
        return "VerifyReport(cells_checked=" + std::to_string(r.cells_checked) +
               ", bytes_checked=" + std::to_string(r.bytes_checked) +
               ", bytes_written=" + std::to_string(r.bytes_written) + ")";
      });
  m.def(
      "verify",
      [](const Plan& p, const Layout& local, const std::vector<Layout>& remotes, const Request& request,
         bool check_minimal) {
        Result<VerifyReport> r = [&] {
          py::gil_scoped_release nogil;
          return verify(p, local, remotes, request, check_minimal);
        }();
        return unwrap(std::move(r));
      },
      py::arg("plan"), py::arg("local"), py::arg("remotes"), py::arg("request"), py::arg("check_minimal") = true,
      "Checks a plan against both layouts without trusting the planner (simulated memory). Returns a\n"
      "VerifyReport; raises Internal naming the first bad byte and its semantic coordinate, or the\n"
      "planner's input error for invalid inputs.");

  py::class_<ContentReport>(m, "ContentReport", "What check_request() found; bad_cells == 0 means byte-exact.")
      .def_readonly("cells", &ContentReport::cells)
      .def_readonly("bytes", &ContentReport::bytes)
      .def_readonly("bad_cells", &ContentReport::bad_cells)
      .def_readonly("first_bad_token", &ContentReport::first_bad_token)
      .def_readonly("first_error", &ContentReport::first_error)
      .def_property_readonly("ok", [](const ContentReport& r) { return r.bad_cells == 0; })
      .def("__repr__", [](const ContentReport& r) {
        return "ContentReport(cells=" + std::to_string(r.cells) + ", bytes=" + std::to_string(r.bytes) +
               ", bad_cells=" + std::to_string(r.bad_cells) + ")";
      });
  m.def(
      "fill_request",
      [](const Layout& layout, const Request& request, py::handle tensors, const std::string& side,
         uint64_t first_token, uint64_t seed) {
        std::vector<std::span<uint8_t>> spans = spans_of(layout, tensors, true);
        py::gil_scoped_release nogil;
        check(fill_request(layout, request, side_of(side), first_token, seed, spans));
      },
      py::arg("layout"), py::arg("request"), py::arg("tensors"), py::arg("side") = "remote", py::arg("first_token") = 0,
      py::arg("seed") = 0,
      "Writes a deterministic pattern of (seed, semantic coordinate) into every cell `request` holds\n"
      "on `side` ('remote' = the prefill side's block ids) at tokens >= first_token. tensors: one\n"
      "host tensor/array per layout tensor (list in layout order, or dict by name).");
  m.def(
      "check_request",
      [](const Layout& layout, const Request& request, py::handle tensors, const std::string& side,
         uint64_t first_token, uint64_t seed) {
        std::vector<std::span<uint8_t>> spans = spans_of(layout, tensors, false);
        Result<ContentReport> r = [&] {
          py::gil_scoped_release nogil;
          return check_request(layout, request, side_of(side), first_token, seed, spans);
        }();
        return unwrap(std::move(r));
      },
      py::arg("layout"), py::arg("request"), py::arg("tensors"), py::arg("side") = "local", py::arg("first_token") = 0,
      py::arg("seed") = 0,
      "Checks the pattern fill_request() writes, on `side` ('local' = the decode side's block ids).\n"
      "Mismatches are in the ContentReport, not raised. Works across TP, block size and order.");
}

}  // namespace kvbridge::python

// Memory of Python objects, and time conversions.
//
// Torch tensors are read through their Python methods (data_ptr, numel,
// element_size, is_contiguous, device) so the extension neither links nor
// includes torch: the same build serves any torch version, or none.
#include <algorithm>
#include <cmath>

#include "bindings.h"
#include "kvbridge/host_memory.h"

namespace kvbridge::python {
namespace {

bool is_torch_tensor(py::handle obj) {
  return py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size") && py::hasattr(obj, "numel") &&
         py::hasattr(obj, "is_contiguous") && py::hasattr(obj, "device");
}

Memory torch_memory(py::handle t, const std::string& what) {
  if (!t.attr("is_contiguous")().cast<bool>()) {
    throw_status(Status::invalid_argument(what + ": the tensor is not contiguous (call .contiguous() on a fresh "
                                                 "allocation; a copy would not be the engine's memory)"));
  }
  Memory m;
  m.data = reinterpret_cast<uint8_t*>(t.attr("data_ptr")().cast<uintptr_t>());
  m.bytes = t.attr("numel")().cast<uint64_t>() * t.attr("element_size")().cast<uint64_t>();
  py::object device = t.attr("device");
  const std::string type = device.attr("type").cast<std::string>();
  if (type == "cpu") {
    m.memory = "host";
  } else if (type == "cuda") {
    py::object index = device.attr("index");
    m.memory = "cuda:" + std::to_string(index.is_none() ? 0 : index.cast<int>());
  } else {
    throw_status(Status::invalid_argument(what + ": tensors on device '" + type +
                                          "' are not supported (expected cpu, or cuda in a build with CUDA)"));
  }
  return m;
}

Memory buffer_memory(py::handle obj, bool writable, const std::string& what) {
  Py_buffer view;
  const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) {
    py::error_already_set e;  // takes the BufferError
    throw_status(Status::invalid_argument(what + ": " + std::string(writable ? "a writable" : "a") +
                                          " C-contiguous buffer is needed (" + e.what() + ")"));
  }
  Memory m;
  m.data = static_cast<uint8_t*>(view.buf);
  m.bytes = static_cast<uint64_t>(view.len);
  // The object keeps owning the memory; callers hold a reference to it.
  PyBuffer_Release(&view);
  return m;
}

}  // namespace

Memory memory_of(py::handle obj, bool writable, const std::string& what) {
  if (is_torch_tensor(obj)) return torch_memory(obj, what);
  if (PyObject_CheckBuffer(obj.ptr())) return buffer_memory(obj, writable, what);
  if (py::isinstance<py::tuple>(obj)) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(obj);
    if (t.size() == 2 || t.size() == 3) {
      Memory m;
      m.data = reinterpret_cast<uint8_t*>(t[0].cast<uintptr_t>());
      m.bytes = t[1].cast<uint64_t>();
      if (t.size() == 3) m.memory = t[2].cast<std::string>();
      return m;
    }
  }
  throw_status(Status::invalid_argument(
      what +
      ": expected a torch tensor, a numpy array (or another buffer), or a (data_ptr, bytes[, memory]) tuple, "
      "not " +
      std::string(py::str(py::type::of(obj).attr("__name__")))));
}

std::vector<Memory> memories_of(py::handle objects, const std::vector<std::string>& names, bool writable) {
  std::vector<Memory> out;
  if (py::isinstance<py::dict>(objects)) {
    py::dict d = py::reinterpret_borrow<py::dict>(objects);
    for (const std::string& n : names) {
      if (!d.contains(n)) throw_status(Status::not_found("no memory given for tensor '" + n + "'"));
      out.push_back(memory_of(d[py::str(n)], writable, "tensor '" + n + "'"));
    }
    if (d.size() != names.size()) {
      for (auto item : d) {
        const std::string k = py::str(item.first);
        if (std::find(names.begin(), names.end(), k) == names.end()) {
          throw_status(Status::not_found("memory given for tensor '" + k + "', which the layout does not have"));
        }
      }
    }
    return out;
  }
  py::sequence s = objects.cast<py::sequence>();
  if (s.size() != names.size()) {
    throw_status(Status::invalid_argument("memory for " + std::to_string(s.size()) + " tensors given, the layout has " +
                                          std::to_string(names.size())));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    out.push_back(memory_of(s[i], writable, "tensor '" + names[i] + "'"));
  }
  return out;
}

std::chrono::milliseconds to_millis(py::handle seconds, std::chrono::milliseconds fallback) {
  if (seconds.is_none()) return fallback;
  double s = 0;
  if (py::hasattr(seconds, "total_seconds")) {
    s = seconds.attr("total_seconds")().cast<double>();
  } else {
    s = seconds.cast<double>();
  }
  if (!std::isfinite(s) || s < 0 || s > 1e9) {
    throw_status(
        Status::invalid_argument("a duration must be finite seconds >= 0, not " + std::string(py::str(seconds))));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(s * 1000)));
}

std::chrono::steady_clock::time_point to_steady(py::handle monotonic) {
  if (monotonic.is_none()) return std::chrono::steady_clock::now();
  const double s = monotonic.cast<double>();
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s)));
}

double from_steady(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

void bind_host_memory(py::module_& m) {
  py::class_<HostMemory>(m, "HostMemory", py::buffer_protocol(),
                         "Host memory for a KV cache that copies between processes fast: anonymous memory\n"
                         "aligned to 2 MiB and advised for transparent huge pages, so a cross-process copy\n"
                         "(cma) pins 512 times fewer pages. It is a writable byte buffer: view it with\n"
                         "numpy.frombuffer(mem, dtype=...) or torch.frombuffer(mem, dtype=...) and register\n"
                         "the view (or the HostMemory itself) with Engine.register_memory. The memory lives\n"
                         "while the HostMemory or any view of it does.\n\n"
                         "    mem = kvbridge.HostMemory(layout.tensors[0].bytes)\n"
                         "    kv = torch.frombuffer(mem, dtype=torch.bfloat16)")
      .def(py::init([](uint64_t nbytes) { return unwrap(HostMemory::allocate(nbytes)); }), py::arg("nbytes"),
           "Maps nbytes (> 0) rounded up to 2 MiB, untouched. Raises InvalidArgument for 0 and\n"
           "ResourceExhausted naming the size when the mapping fails.")
      .def_property_readonly("nbytes", &HostMemory::size, "The bytes asked for.")
      .def_property_readonly(
          "address", [](const HostMemory& h) { return reinterpret_cast<uintptr_t>(h.data()); },
          "Where it starts (a multiple of 2 MiB).")
      .def_property_readonly("huge_pages", &HostMemory::huge_pages,
                             "True when the kernel took the advice; huge_pages_note says why not otherwise.")
      .def_property_readonly("huge_pages_note", &HostMemory::huge_pages_note)
      .def("__len__", &HostMemory::size)
      .def_buffer([](HostMemory& h) {
        return py::buffer_info(h.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(h.size())}, {1});
      });
}

}  // namespace kvbridge::python

// The exception hierarchy and the one map from Code to exception class.
//
// Every class derives from kvbridge.Error; where a Python built-in means the
// same thing the class derives from it too (InvalidArgument is a ValueError,
// Timeout a TimeoutError, ...), so code that already catches the built-in
// keeps working. str(exception) is the Status message unchanged; `.code` is
// the code's stable name ("incompatible").
#include <array>

#include "bindings.h"

namespace kvbridge::python {
namespace {

struct ExceptionSpec {
  Code code;
  const char* name;
  PyObject* builtin;  // a second base, or nullptr
  const char* doc;
};

constexpr size_t kCodes = static_cast<size_t>(Code::kPermissionDenied) + 1;

// Filled once by bind_errors(); the types live as long as the interpreter
// (deliberately never released: module teardown order is not ours to rely on).
std::array<PyObject*, kCodes> g_types{};
PyObject* g_base = nullptr;

std::vector<ExceptionSpec> specs() {
  return {
      {Code::kInvalidArgument, "InvalidArgument", PyExc_ValueError,
       "Malformed input: bad JSON, a bad field or option. The message names the field or JSON path."},
      {Code::kOutOfRange, "OutOfRange", PyExc_IndexError,
       "An index, offset or size outside what it refers to (a block id past num_blocks, a cell past its tensor)."},
      {Code::kIncompatible, "Incompatible", nullptr,
       "Two valid things that cannot work together, e.g. layouts whose identities differ. The message names the\n"
       "first field that differs and both values."},
      {Code::kNotFound, "NotFound", PyExc_LookupError, "A named thing (group, tensor, peer, request) does not exist."},
      {Code::kAlreadyExists, "AlreadyExists", nullptr, "A name or id is used twice."},
      {Code::kResourceExhausted, "ResourceExhausted", nullptr, "A bound on size or count was exceeded."},
      {Code::kUnavailable, "Unavailable", nullptr,
       "A transport or peer cannot be used here; the message says why (or a resource is in use)."},
      {Code::kTimeout, "Timeout", PyExc_TimeoutError, "A deadline passed."},
      {Code::kCancelled, "Cancelled", nullptr, "The operation was cancelled."},
      {Code::kIoError, "IoError", PyExc_OSError, "The OS or the network failed."},
      {Code::kInternal, "Internal", nullptr, "A broken invariant: a bug in kvbridge (please report it)."},
      {Code::kPermissionDenied, "PermissionDenied", PyExc_PermissionError,
       "Authentication failed: a missing or wrong shared secret."},
  };
}

}  // namespace

py::object exception_for(const Status& status) {
  PyObject* type = g_types[static_cast<size_t>(status.code())];
  if (status.ok() || type == nullptr) type = g_base;
  py::object exc = py::reinterpret_borrow<py::object>(type)(status.message());
  exc.attr("code") = std::string(code_name(status.code()));
  return exc;
}

Code parse_code(const std::string& name) {
  for (size_t i = 0; i < kCodes; ++i) {
    if (code_name(static_cast<Code>(i)) == name) return static_cast<Code>(i);
  }
  throw_status(Status::invalid_argument("unknown status code '" + name + "'"));
}

void bind_errors(py::module_& m) {
  g_base = PyErr_NewExceptionWithDoc("kvbridge.Error",
                                     "Base class of every kvbridge error.\n\n"
                                     "str(e) is the library's message, which names what is wrong (the group, layer\n"
                                     "and component of a layout, the field that differs, the peer); e.code is the\n"
                                     "status code's stable name, e.g. 'incompatible'.",
                                     PyExc_Exception, nullptr);
  if (g_base == nullptr) throw py::error_already_set();
  m.add_object("Error", py::handle(g_base).inc_ref());
  py::dict by_code;
  for (const ExceptionSpec& s : specs()) {
    py::tuple bases = s.builtin != nullptr ? py::make_tuple(py::handle(g_base), py::handle(s.builtin))
                                           : py::make_tuple(py::handle(g_base));
    const std::string qualified = std::string("kvbridge.") + s.name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), s.doc, bases.ptr(), nullptr);
    if (type == nullptr) throw py::error_already_set();
    g_types[static_cast<size_t>(s.code)] = type;
    m.add_object(s.name, py::handle(type).inc_ref());
    by_code[py::str(std::string(code_name(s.code)))] = py::handle(type);
  }
  m.attr("EXCEPTIONS_BY_CODE") = by_code;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = exception_for(e.status);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<Status>(m, "Status",
                     "A status value: OK, or a code and a message naming what is wrong.\n\n"
                     "Appears in results that report errors instead of raising them (TransferStatus.error,\n"
                     "LoadResult.error, RequestOutcome.error). raise_if_error() raises the matching\n"
                     "kvbridge exception.")
      .def(py::init(
               [](const std::string& code, const std::string& message) { return Status(parse_code(code), message); }),
           py::arg("code") = "ok", py::arg("message") = "",
           "Status(code='ok', message=''): code is a stable name such as 'invalid_argument'.")
      .def_property_readonly("ok", &Status::ok, "True when there is no error.")
      .def_property_readonly(
          "code", [](const Status& s) { return std::string(code_name(s.code())); },
          "The code's stable name: 'ok', 'invalid_argument', 'incompatible', ...")
      .def_property_readonly("message", &Status::message, "The message ('' when OK).")
      .def(
          "exception", [](const Status& s) -> py::object { return s.ok() ? py::none() : exception_for(s); },
          "The kvbridge exception for this status (not raised), or None when OK.")
      .def(
          "raise_if_error", [](const Status& s) { check(s); }, "Raises the matching kvbridge exception unless OK.")
      .def("__str__", &Status::to_string)
      .def("__repr__", [](const Status& s) { return "<kvbridge.Status " + s.to_string() + ">"; })
      .def("__eq__",
           [](const Status& a, const Status& b) { return a.code() == b.code() && a.message() == b.message(); })
      .def(py::pickle([](const Status& s) { return py::make_tuple(std::string(code_name(s.code())), s.message()); },
                      [](const py::tuple& t) {
                        if (t.size() != 2) throw py::value_error("Status: a pickled state is (code, message)");
                        return Status(parse_code(t[0].cast<std::string>()), t[1].cast<std::string>());
                      }));
}

}  // namespace kvbridge::python

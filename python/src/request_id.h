// python/src/request_id.h: a request id as Python passes it (connector
// and scheduler bindings).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace kvbridge::python {

// A request id as Python passes it: a str, or an int taken as its decimal
// text (engines whose ids are integers); it converts to RequestId.
struct Rid : std::string {
  Rid() = default;
  explicit Rid(std::string s) : std::string(std::move(s)) {}
};

}  // namespace kvbridge::python

namespace pybind11::detail {
template <>
struct type_caster<kvbridge::python::Rid> {
  PYBIND11_TYPE_CASTER(kvbridge::python::Rid, const_name("str"));
  bool load(handle src, bool) {
    if (PyUnicode_Check(src.ptr())) {
      value = kvbridge::python::Rid(src.cast<std::string>());
      return true;
    }
    if (PyLong_Check(src.ptr()) && !PyBool_Check(src.ptr())) {
      value = kvbridge::python::Rid(pybind11::str(src).cast<std::string>());
      return true;
    }
    return false;
  }
  static handle cast(const kvbridge::python::Rid& v, return_value_policy, handle) {
    return PyUnicode_FromStringAndSize(v.data(), static_cast<Py_ssize_t>(v.size()));
  }
};
}  // namespace pybind11::detail

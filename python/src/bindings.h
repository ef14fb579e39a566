// python/src/bindings.h: what the parts of the `_kvbridge` extension share.
//
// The extension is split by concern (errors, memory, layout, plan, engine,
// connector); module.cc calls each bind_* in dependency order. Errors reach
// Python only through throw_status() (errors.cc), the one place that maps a
// Code to an exception class.
//
// Thread-safety: everything here runs with the GIL held unless a function
// says otherwise.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/connector.h"
#include "kvbridge/status.h"

namespace kvbridge::python {

namespace py = pybind11;

// errors.cc -----------------------------------------------------------------

// Thrown by the bindings; translated to the exception class of its code
// (kvbridge.InvalidArgument, ...), message kept. Requires a non-OK status.
struct StatusError {
  Status status;
};

[[noreturn]] inline void throw_status(const Status& status) { throw StatusError{status}; }
inline void check(const Status& status) {
  if (!status.ok()) throw_status(status);
}
template <typename T>
T unwrap(Result<T>&& result) {
  if (!result.ok()) throw_status(result.error());
  return std::move(result).value();
}

// The exception instance for a non-OK status (for Status.exception()).
py::object exception_for(const Status& status);
// A Code from its lower-case name ("invalid_argument"); kInvalidArgument
// error for an unknown name.
Code parse_code(const std::string& name);

// memory.cc -----------------------------------------------------------------

// One contiguous piece of memory a Python object exposes: a torch tensor (by
// data_ptr(), numel() and element_size(), without linking torch), anything
// with the buffer protocol (numpy arrays, bytearray, memoryview), or a
// (data_ptr, bytes) / (data_ptr, bytes, memory) tuple of a raw allocation.
struct Memory {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::string memory = "host";  // "host" or "cuda:N"
};

// kInvalidArgument (naming `what`) for a non-contiguous tensor or buffer, a
// read-only buffer when `writable`, or an object that is none of the above.
// The memory stays owned by `obj`: callers keep a reference while they use it.
Memory memory_of(py::handle obj, bool writable, const std::string& what);

// Host memory of each object of a list (or a dict by tensor name, given the
// names in order), as spans for content.h and ConnectorWorker::create.
std::vector<Memory> memories_of(py::handle objects, const std::vector<std::string>& names, bool writable);

// Seconds (float) or datetime.timedelta, to a duration; None gives `fallback`.
std::chrono::milliseconds to_millis(py::handle seconds, std::chrono::milliseconds fallback);

// engine.cc ------------------------------------------------------------------

// A producer's (or consumer's) readiness from Python: None (nothing), a
// torch.cuda.Event (its IPC handle when interprocess, else its cudaEvent_t),
// bytes of an IPC event handle, or an int cudaEvent_t of this process.
// kInvalidArgument (thrown) for anything else.
Readiness readiness_of(py::handle ready);

// The longest a blocking wait holds off Python (it waits with the GIL
// released, in slices of this, and checks for a KeyboardInterrupt between).
inline constexpr std::chrono::milliseconds kWaitSlice{100};

// A time.monotonic() value (seconds) as a steady_clock time point (both read
// CLOCK_MONOTONIC on Linux); None is now.
std::chrono::steady_clock::time_point to_steady(py::handle monotonic);
double from_steady(std::chrono::steady_clock::time_point t);

// bind_* ----------------------------------------------------------------------

void bind_errors(py::module_& m);
void bind_layout(py::module_& m);
void bind_plan(py::module_& m);
void bind_engine(py::module_& m);
void bind_host_memory(py::module_& m);  // memory.cc
void bind_schedulers(py::module_& m);   // schedulers.cc; called by bind_connector
void bind_connector(py::module_& m);
void bind_connector_values(py::module_& m);  // connector_values.cc; called by bind_connector
void bind_store(py::module_& m);
// kvbridge.testing's device hooks (device.cc) and its engine with faults
// (engine.cc); after bind_connector, which makes the submodule.
void bind_device_testing(py::module_& m);
void bind_engine_testing(py::module_& m);

}  // namespace kvbridge::python

// kvbridge.testing's device hooks: device memory, a slow producer and its
// event on the process's device, so the Python tests drive device memory
// through the engine on the host fake (KVB_DEVICE=fake) as they would with
// torch CUDA tensors on a GPU. Not part of the API.
#include <chrono>
#include <cstring>

#include "bindings.h"
#include "device/device.h"

namespace kvbridge::python {

void bind_device_testing(py::module_& m) {
  py::module_ t = m.attr("testing");
  t.def(
      "device_name", [] { return std::string(device::current().name()); },
      "'cuda', or 'fake' when KVB_DEVICE=fake chose the host fake.");
  t.def(
      "device_allocate",
      [](int device, uint64_t bytes) {
        return reinterpret_cast<uintptr_t>(unwrap(device::current().allocate(device, bytes)));
      },
      py::arg("device"), py::arg("bytes"), "Device memory of `device`; its address.");
  t.def(
      "device_free", [](uintptr_t p) { check(device::current().free(reinterpret_cast<void*>(p))); }, py::arg("ptr"));
  t.def(
      "device_write",
      [](uintptr_t p, py::bytes data) {
        const std::string s = data;
        check(device::current().copy_sync(reinterpret_cast<void*>(p), s.data(), s.size()));
      },
      py::arg("ptr"), py::arg("data"), "Copies `data` to device memory at `ptr`.");
  t.def(
      "device_read",
      [](uintptr_t p, uint64_t n) {
        std::string s(n, '\0');
        check(device::current().copy_sync(s.data(), reinterpret_cast<const void*>(p), n));
        return py::bytes(s);
      },
      py::arg("ptr"), py::arg("bytes"), "Copies `bytes` from device memory at `ptr`.");
  t.def(
      "device_fill_later",
      [](int device, uintptr_t p, uint64_t n, uint8_t value, double delay_s) {
        device::Device& d = device::current();
        // The stream and event live as long as the process: a test's
        // producer may still be running when its test ends.
        static device::Stream stream = unwrap(d.create_stream(device));
        device::Event event = unwrap(d.create_event(device, true));
        check(d.fill_after(stream, reinterpret_cast<void*>(p), n, value,
                           std::chrono::microseconds(static_cast<int64_t>(delay_s * 1e6))));
        check(d.record(event, stream));
        return py::bytes(unwrap(d.export_event(event)));
      },
      py::arg("device"), py::arg("ptr"), py::arg("bytes"), py::arg("value"), py::arg("delay"),
      "Queues a slow producer: after `delay` seconds it sets the bytes to `value`. Returns the IPC\n"
      "handle of the event recorded after it.");
}

}  // namespace kvbridge::python

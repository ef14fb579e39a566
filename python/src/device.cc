// kvbridge.testing's device hooks: device memory, a slow producer and its
// event on the process's device, so the Python tests drive device memory
// through the engine on the host fake (KVB_DEVICE=fake) as they would with
// torch CUDA tensors on a GPU. Not part of the API.
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include <pybind11/stl.h>

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
  // The slow producers' streams, by key: each a device's stream as a rank's
  // compute stream is. They live as long as the process.
  static std::map<std::pair<int, int>, device::Stream>* streams = new std::map<std::pair<int, int>, device::Stream>();
  auto stream_of = [](int device, int key) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    auto it = streams->find({device, key});
    if (it == streams->end())
      it = streams->emplace(std::make_pair(device, key), unwrap(device::current().create_stream(device))).first;
    return it->second;
  };
  t.def(
      "device_copy_later",
      [stream_of](int device, std::vector<std::tuple<uintptr_t, uintptr_t, uint64_t>> copies, double delay_s,
                  int stream) {
        device::Device& d = device::current();
        device::Stream s = stream_of(device, stream);
        device::Event event = unwrap(d.create_event(device, true));
        std::vector<device::DeviceCopy> batch;
        for (const auto& [dst, src, n] : copies) {
          batch.push_back({reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n});
        }
        if (!batch.empty()) {
          check(
              d.fill_after(s, batch.front().dst, 0, 0, std::chrono::microseconds(static_cast<int64_t>(delay_s * 1e6))));
          check(d.copy(s, batch, device::CopyMethod::kCopyEngine));
        }
        check(d.record(event, s));
        std::string handle = unwrap(d.export_event(event));
        // Kept for the readers that open the handle soon after; the oldest
        // goes past a bound (each holds a descriptor on the fake).
        static std::mutex events_mu;
        static std::deque<device::Event>* events = new std::deque<device::Event>();
        std::lock_guard<std::mutex> lock(events_mu);
        events->push_back(event);
        if (events->size() > 256) {
          d.destroy_event(events->front());
          events->pop_front();
        }
        return py::bytes(handle);
      },
      py::arg("device"), py::arg("copies"), py::arg("delay"), py::arg("stream") = 0,
      "Queues a slow producer's writes on stream `stream` of `device` (streams by key, made on\n"
      "first use): after `delay` seconds of a kernel, the copies (dst, src, bytes) of device or\n"
      "host memory. Returns the IPC handle of the event recorded after them.");
  t.def(
      "device_drain",
      [stream_of](int device, int stream) {
        device::Device& d = device::current();
        device::Event event = unwrap(d.create_event(device, false));
        check(d.record(event, stream_of(device, stream)));
        {
          py::gil_scoped_release nogil;
          while (!unwrap(d.done(event))) std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        d.destroy_event(event);
      },
      py::arg("device"), py::arg("stream") = 0,
      "Waits until the work queued on stream `stream` of `device` (device_copy_later's) ran.");
}

}  // namespace kvbridge::python

// The `_kvbridge` extension module; the package `kvbridge` re-exports it.
#include "bindings.h"
#include "device/device.h"

PYBIND11_MODULE(_kvbridge, m) {
  namespace py = pybind11;
  m.doc() =
      "kvbridge: moves LLM KV caches between inference workers.\n\n"
      "Layouts describe how a rank's KV cache sits in memory; plan() turns a request into the\n"
      "descriptors that move it; Engine moves bytes between processes; the connector roles\n"
      "(PrefillScheduler, DecodeScheduler, ConnectorWorker) run prefill/decode disaggregation.\n"
      "Errors raise subclasses of kvbridge.Error, one per status code.";
  m.attr("__version__") = KVB_VERSION;
#ifdef KVB_HAVE_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.def(
      "cuda_devices",
      [] {
        kvbridge::Result<int> n = kvbridge::device::current().count();
        return kvbridge::python::unwrap(std::move(n));
      },
      "The number of CUDA devices this process can use. Raises Unavailable saying why there are\n"
      "none: a build without CUDA (has_cuda is False), no driver, no GPU.");
  kvbridge::python::bind_errors(m);
  kvbridge::python::bind_layout(m);
  kvbridge::python::bind_plan(m);
  kvbridge::python::bind_host_memory(m);
  kvbridge::python::bind_engine(m);
  kvbridge::python::bind_connector(m);
  kvbridge::python::bind_store(m);
  kvbridge::python::bind_device_testing(m);
  kvbridge::python::bind_engine_testing(m);
}

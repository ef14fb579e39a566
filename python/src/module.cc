// The `_kvbridge` extension module; the package `kvbridge` re-exports it.
#include "bindings.h"

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
  kvbridge::python::bind_errors(m);
  kvbridge::python::bind_layout(m);
  kvbridge::python::bind_plan(m);
  kvbridge::python::bind_engine(m);
  kvbridge::python::bind_connector(m);
  kvbridge::python::bind_store(m);
}

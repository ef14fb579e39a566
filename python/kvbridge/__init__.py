"""kvbridge: moves LLM KV caches between inference workers.

The pieces, from the bottom up:

- Layout: how one rank's KV cache sits in memory (kvbridge.layout/3). Build one from JSON
  (Layout.from_json, Layout.load), from a preset (make_preset), or from the engine's own
  torch tensors (layout_from_tensors).
- plan(local, remotes, request) -> Plan: the descriptors that move one request's KV; their
  numpy view is Plan.descriptors; verify() checks a plan independently.
- Engine: registered memory (torch tensors, numpy arrays), peers, asynchronous transfers,
  notifications, metrics.
- PrefillScheduler, DecodeScheduler, ConnectorWorker: prefill/decode disaggregation.
- Store, RankStore: the prefix store (lookup, get, put) over a rank's tensors.
- kvbridge.connector_v1: the KV-connector method set engines implement (scheduler half and
  worker half, plain values in and out) over all of the above.
- Errors: kvbridge.Error and one subclass per status code (InvalidArgument, Incompatible, ...),
  with the library's message unchanged.

See docs/python.md, docs/integration.md, examples/pd_torch.py and examples/connector_v1_pd.py.
"""

from ._kvbridge import *  # noqa: F401,F403
from ._kvbridge import (  # noqa: F401
    EXCEPTIONS_BY_CODE,
    __version__,
    descriptor_dtype,
    has_cuda,
    testing,  # hooks for tests and tools, not part of the API
)
from ._layout_builder import describe_tensor, dtype_name, layout_dict_from_tensors, layout_from_tensors  # noqa: F401

__all__ = [
    # errors
    "Error", "InvalidArgument", "OutOfRange", "Incompatible", "NotFound", "AlreadyExists", "ResourceExhausted",
    "Unavailable", "Timeout", "Cancelled", "IoError", "Internal", "PermissionDenied", "Status", "EXCEPTIONS_BY_CODE",
    # layouts
    "Layout", "Tensor", "Group", "Layer", "Component", "Axis", "HeadMap", "ContextShard", "Request", "GroupBlocks",
    "make_preset", "preset_names", "preset_summary", "compare_identity_text",
    "layout_from_tensors", "layout_dict_from_tensors", "describe_tensor", "dtype_name",
    # plans
    "Plan", "SourceTotals", "plan", "naive_descriptor_count", "source_ranks", "readers_per_source", "layer_order",
    "verify", "VerifyReport", "descriptor_dtype",
    "fill_request", "check_request", "ContentReport",
    # engine
    "Engine", "TransferOp", "TransferState", "TransferItem", "TransferStatus", "Notification", "TransportReport",
    "EngineMetrics", "HostMemory",
    # connector
    "PrefillScheduler", "DecodeScheduler", "ConnectorWorker", "Release", "RequestOutcome", "LoadResult",
    "ReaderEvent", "WorkerStats",
    # prefix store
    "Store", "RankStore", "PutResult", "LookupResult", "GetResult",
    "__version__", "has_cuda", "cuda_devices",
]

# Present every class as kvbridge.X (help(), repr and pickle), not kvbridge._kvbridge.X.
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) and getattr(_obj, "__module__", "") == "kvbridge._kvbridge":
        try:
            _obj.__module__ = "kvbridge"
        except (AttributeError, TypeError):
            pass
del _name, _obj

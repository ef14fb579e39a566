"""kvbridge.connector_v1: the KV-connector interface serving engines already implement, over kvbridge.

Engines split a KV connector in two halves (vLLM's KVConnectorBase_V1 has this method set):

- a scheduler half (``SchedulerConnector``, one per instance, in the scheduler process) that
  decides what each request loads and holds: ``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``,
  ``update_connector_output``;
- a worker half (``WorkerConnector``, one per rank, in the rank's process) that moves bytes:
  ``register_kv_caches``, ``bind_connector_metadata``, ``start_load_kv``,
  ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``, ``get_finished``,
  ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``.

Nothing here imports an engine: requests are ids, token id lists and block id lists (one
list per group, a flat list for a single group, or a tuple of lists in layout group
order); caches are torch tensors by layer name; everything passed between the halves
(``ConnectorMetadata``, ``WorkerOutput``, the ``kv_transfer_params`` dicts) is plain and
pickles, so it can cross the engine's process boundaries.

What it does (docs/integration.md has the whole method map):

- **P/D pull.** A prefill instance's ``request_finished`` holds the request's blocks (lease,
  renewed by the readers' heartbeats) and returns the ``kv_transfer_params`` the router
  forwards to the decode instance; there ``get_num_new_matched_tokens`` reports the prompt as
  external and asynchronous, and each decode rank reads its share (any TP, block size, layer
  order) from the fewest prefill ranks. The prefill blocks are free once every decode rank
  said done (``finished_sending``); a decode request is ready once every rank's load ended
  (``finished_recving``, with its outcome: finished, failed, or recompute from a token).
- **The prefix store.** With ``store_hash_block_tokens`` set, lookups count stored prefix
  tokens as external, loads write them into the request's blocks, and finished requests are
  stored (their blocks freed once stored).
- **Combined loads.** A decode request whose prompt starts with a stored prefix loads that
  prefix from the store and only the rest from the prefill instance, in one
  ``start_load_kv``: the P/D read starts at the first token the store did not deliver, so no
  token is fetched twice (a shortfall of the store is read from prefill instead).
- **Layer-wise hooks.** A decode request loaded with ``stream`` reads each layer as soon as
  the prefill ranks saved it (``save_kv_layer`` there, ``wait_for_layer_load`` here).

Push (prefill writing into decode's blocks) is not available: every load is a pull.
"""

from __future__ import annotations

# The implementation is split by part into private modules (_connector_config, _connector_meta,
# _connector_scheduler, _connector_worker); this module is the public face of all of them.
# The names the dataclasses' annotations use are here too, so typing.get_type_hints() resolves
# them with the classes presented as this module's.
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple  # noqa: F401

from ._connector_config import CACHE_LAYOUTS, ROLES, ConnectorConfig
from ._connector_meta import (  # noqa: F401
    BlockIds,
    ConnectorMetadata,
    FinishedRequests,
    HandshakeMetadata,
    LoadSpec,
    SaveSpec,
    StreamSpec,
    WorkerOutput,
)
from ._connector_scheduler import SchedulerConnector
from ._connector_worker import WorkerConnector

__all__ = [
    "ConnectorConfig", "SchedulerConnector", "WorkerConnector", "ConnectorMetadata", "LoadSpec", "SaveSpec",
    "StreamSpec", "WorkerOutput", "FinishedRequests", "ROLES", "CACHE_LAYOUTS",
]

# Present the public classes as kvbridge.connector_v1.X (repr, help() and pickle: a pickle names
# the public module, never a private one that another version may lay out differently).
for _cls in (ConnectorConfig, HandshakeMetadata, LoadSpec, SaveSpec, StreamSpec, ConnectorMetadata, WorkerOutput,
             FinishedRequests, SchedulerConnector, WorkerConnector):
    _cls.__module__ = __name__
del _cls

"""What kvbridge.connector_v1's halves pass each other: plain dataclasses that pickle, so they cross
the engine's process boundaries. Private: kvbridge.connector_v1 re-exports the public names."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Union

# Block ids of one request: {group: [ids]}, a flat list (a layout with one group), or a
# tuple of lists in the layout's group order (as engines with several groups hand them).
BlockIds = Union[Mapping[str, Sequence[int]], Sequence[int], Sequence[Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class HandshakeMetadata:
    """What one rank tells its scheduler half (WorkerConnector.get_handshake_metadata()): the
    address of its side channel, and its incarnation (its engine's instance id: a restarted rank
    has another, so a hand-off that names it is never read from a stranger)."""
    address: str
    incarnation: str = ""


@dataclasses.dataclass
class LoadSpec:
    """A request a decode (or store-reading) rank loads in this step.

    Tokens [0, skip_tokens) are already in the local blocks (the engine's own prefix cache);
    [skip_tokens, store_tokens) come from the prefix store (store_tokens 0: none); the rest up
    to num_tokens from the remote instance (remote_instance None: none)."""
    request_id: str
    local_blocks: Any
    num_tokens: int
    skip_tokens: int = 0
    store_tokens: int = 0
    token_ids: Optional[List[int]] = None
    remote_instance: Optional[str] = None
    remote_addresses: Optional[List[str]] = None
    remote_blocks: Any = None
    remote_request_id: Optional[str] = None  # the prefill's id of the request (its readers' messages name it)
    remote_incarnations: Optional[List[str]] = None  # each prefill rank's, as the hand-off named them
    stream: bool = False

    @property
    def load_id(self) -> str:
        return self.remote_request_id or self.request_id


@dataclasses.dataclass
class SaveSpec:
    """A finished request whose first num_tokens tokens each rank stores in the prefix store."""
    request_id: str
    token_ids: List[int]
    num_tokens: int
    local_blocks: Any


@dataclasses.dataclass
class StreamSpec:
    """Prefill: a request whose layers each rank announces to a decode instance as it saves them."""
    request_id: str
    instance: str
    addresses: List[str]
    finishes: bool = True  # the request's prefill ends in this step: save_kv_layer announces its layers


@dataclasses.dataclass
class ConnectorMetadata:
    """What build_connector_meta() hands the workers for one step (plain values; pickles)."""
    loads: List[LoadSpec] = dataclasses.field(default_factory=list)
    saves: List[SaveSpec] = dataclasses.field(default_factory=list)
    streams: List[StreamSpec] = dataclasses.field(default_factory=list)
    aborts: List[str] = dataclasses.field(default_factory=list)
    # Prefill: requests handed off (their blocks, by request id): each rank lets the readers that
    # heartbeat for one read its blocks, and nothing else, until they are released.
    hand_offs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # Prefill: requests whose held blocks the engine frees now: each rank says so to its readers
    # before anything can write those blocks again (a read that may have seen the next owner fails).
    released: List[str] = dataclasses.field(default_factory=list)
    # The readers whose done came before each release: their dones that reach a rank later are
    # answered "held" (their reads ended while the blocks were the request's).
    released_readers: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    # Requests the step's batch computes whose KV streams in (build_connector_meta(scheduled=)):
    # wait_for_layer_load() waits for these only, never for loads the batch does not compute.
    computes: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class WorkerOutput:
    """What one rank tells the scheduler after a step (build_connector_worker_meta(); pickles)."""
    rank: int
    load_results: List[Any] = dataclasses.field(default_factory=list)  # kvbridge.LoadResult
    reader_events: List[Any] = dataclasses.field(default_factory=list)  # kvbridge.ReaderEvent
    saved: List[str] = dataclasses.field(default_factory=list)
    save_errors: Dict[str, str] = dataclasses.field(default_factory=dict)
    stream_errors: Dict[str, str] = dataclasses.field(default_factory=dict)  # prefill: announcements that failed
    hand_off_errors: Dict[str, str] = dataclasses.field(default_factory=dict)  # prefill: hand-offs refused


@dataclasses.dataclass
class FinishedRequests:
    """What the scheduler half learned: requests whose blocks may be freed now (the ones
    request_finished() said to keep), and requests whose asynchronous load ended, with
    each one's outcome (kvbridge.RequestOutcome: finished, failed, recompute, aborted)."""
    finished_sending: Set[str] = dataclasses.field(default_factory=set)
    finished_recving: Set[str] = dataclasses.field(default_factory=set)
    outcomes: Dict[str, Any] = dataclasses.field(default_factory=dict)

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

import dataclasses
import threading
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from . import _kvbridge as _kvb
from ._layout_builder import layout_from_tensors

__all__ = [
    "ConnectorConfig", "SchedulerConnector", "WorkerConnector", "ConnectorMetadata", "LoadSpec", "SaveSpec",
    "StreamSpec", "WorkerOutput", "FinishedRequests", "ROLES", "CACHE_LAYOUTS",
]

ROLES = ("prefill", "decode", "both")
CACHE_LAYOUTS = ("flash_attn", "flash_infer", "mla")

# Block ids of one request: {group: [ids]}, a flat list (a layout with one group), or a
# tuple of lists in the layout's group order (as engines with several groups hand them).
BlockIds = Union[Mapping[str, Sequence[int]], Sequence[int], Sequence[Sequence[int]]]


def _fail(what: str) -> _kvb.InvalidArgument:
    return _kvb.InvalidArgument(f"connector_v1: {what}")


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """One instance's connector settings; the same object configures both halves (it pickles).

    instance_id: this instance's name (its ranks' engines are "<instance_id>/r<rank>").
    role: "prefill" (computes KV that decode instances read), "decode" (reads it) or "both".
    tp_size: the instance's ranks.
    model, num_kv_heads, cache_layout, groups: how register_kv_caches() reads the caches
      (see there). num_kv_heads is the model's total KV heads; needed when a rank holds one
      head at TP above 1 (replicated or not cannot be told from one rank).
    decode_ranks: prefill: how many decode ranks read each request, when the request's
      kv_transfer_params do not say ("decode_ranks"); the blocks are held until that many
      decode ranks said done (or the lease expires). Must be given one way or the other.
    lease_s: how long prefill holds a request's blocks without a heartbeat from a reader.
    failure_policy: decode: "fail" or "recompute" (from the first token that did not arrive).
    load_timeout_s: decode: a load not ended by then fails.
    store_hash_block_tokens: 0 for no prefix store; else its hash block (tokens), with
      store_memory_bytes of memory tier per process and store_redis ("host:port") as the
      shared tier (needed for hits across processes). store_save: store finished requests.
    lookup_keep_last_token: a prefix-store lookup leaves the last prompt token to compute
      (the engine needs its logits).
    stream: decode: load layer by layer, as the prefill saves each (the prefill must stream
      to this instance: kv_transfer_params "stream_to").
    host, advertise_host, secret, handshake_timeout_s, verify_plans, load_chunk_tokens:
      passed to each rank's Engine and ConnectorWorker.
    engine_faults: fault injection into each rank's Engine, for tests only (Engine(faults=)).
    """

    instance_id: str
    role: str = "both"
    tp_size: int = 1
    model: str = "model"
    num_kv_heads: Optional[int] = None
    cache_layout: str = "flash_attn"
    groups: Optional[Mapping[str, Mapping[str, Any]]] = None
    decode_ranks: Optional[int] = None
    lease_s: float = 30.0
    failure_policy: str = "fail"
    load_timeout_s: float = 30.0
    store_hash_block_tokens: int = 0
    store_memory_bytes: int = 1 << 30
    store_redis: Optional[str] = None
    store_save: bool = True
    lookup_keep_last_token: bool = True
    stream: bool = False
    host: str = "127.0.0.1"
    advertise_host: str = ""
    secret: str = ""
    handshake_timeout_s: float = 5.0
    verify_plans: bool = False
    load_chunk_tokens: int = 2048
    engine_faults: str = ""

    def __post_init__(self) -> None:
        if not self.instance_id or any(not ch.isprintable() or ch.isspace() for ch in self.instance_id):
            raise _fail(f"instance_id {self.instance_id!r} (expected printable text without spaces)")
        if self.role not in ROLES:
            raise _fail(f"role '{self.role}' (expected one of {', '.join(ROLES)})")
        if self.tp_size < 1:
            raise _fail(f"tp_size {self.tp_size} (expected at least 1)")
        if self.cache_layout not in CACHE_LAYOUTS:
            raise _fail(f"cache_layout '{self.cache_layout}' (expected one of {', '.join(CACHE_LAYOUTS)})")
        if self.failure_policy not in ("fail", "recompute"):
            raise _fail(f"failure_policy '{self.failure_policy}' (expected fail or recompute)")
        if self.decode_ranks is not None and self.decode_ranks < 1:
            raise _fail(f"decode_ranks {self.decode_ranks} (expected at least 1)")

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def has_store(self) -> bool:
        return self.store_hash_block_tokens > 0


# One Store per process and store configuration: the scheduler half and the worker halves of
# one process share its memory tier.
_STORES: Dict[Tuple[int, int, Optional[str]], "_kvb.Store"] = {}
_STORES_LOCK = threading.Lock()


def _store_for(config: ConnectorConfig) -> "_kvb.Store":
    key = (config.store_hash_block_tokens, config.store_memory_bytes, config.store_redis)
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = _kvb.Store(hash_block_tokens=config.store_hash_block_tokens,
                                      memory_bytes=config.store_memory_bytes, redis=config.store_redis,
                                      assembly="shared" if config.store_redis else "in_process")
        return _STORES[key]


def _tokens(token_ids: Any) -> List[int]:
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    return [int(t) for t in token_ids]


def _plain_blocks(block_ids: BlockIds) -> Union[Dict[str, List[int]], List[int], List[List[int]]]:
    """Block ids as plain lists (what the metadata carries), in the shape given."""
    if isinstance(block_ids, Mapping):
        return {str(g): [int(b) for b in ids] for g, ids in block_ids.items()}
    items = list(block_ids)
    if items and not isinstance(items[0], (int,)) and hasattr(items[0], "__iter__"):
        return [[int(b) for b in ids] for ids in items]
    return [int(b) for b in items]


# ---------------------------------------------------------------------------- metadata


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


@dataclasses.dataclass
class WorkerOutput:
    """What one rank tells the scheduler after a step (build_connector_worker_meta(); pickles)."""
    rank: int
    load_results: List[Any] = dataclasses.field(default_factory=list)  # kvbridge.LoadResult
    reader_events: List[Any] = dataclasses.field(default_factory=list)  # kvbridge.ReaderEvent
    saved: List[str] = dataclasses.field(default_factory=list)
    save_errors: Dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FinishedRequests:
    """What the scheduler half learned: requests whose blocks may be freed now (the ones
    request_finished() said to keep), and requests whose asynchronous load ended, with
    each one's outcome (kvbridge.RequestOutcome: finished, failed, recompute, aborted)."""
    finished_sending: Set[str] = dataclasses.field(default_factory=set)
    finished_recving: Set[str] = dataclasses.field(default_factory=set)
    outcomes: Dict[str, Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------- scheduler half


@dataclasses.dataclass
class _Pending:
    tokens: List[int]
    computed: int
    params: Optional[Dict[str, Any]]
    store_hit: int


class SchedulerConnector:
    """The scheduler half: one per instance. Not thread-safe (the engine's scheduler loop owns it).

    layout: a rank's Layout (for prefix-store lookups; WorkerConnector.layout of rank 0);
    needed only with a prefix store.
    """

    def __init__(self, config: ConnectorConfig, layout: Optional["_kvb.Layout"] = None) -> None:
        self.config = config
        self._lookup: Optional["_kvb.RankStore"] = None
        if config.has_store:
            if layout is None:
                raise _fail("a prefix store needs the scheduler to know a rank's layout (layout=)")
            self._lookup = _kvb.RankStore(_store_for(config), layout, None)
        self._addresses: List[str] = []
        self._prefill = _kvb.PrefillScheduler(lease=config.lease_s)
        self._decode = _kvb.DecodeScheduler(ranks=config.tp_size, policy=config.failure_policy)
        self._pending: Dict[str, _Pending] = {}
        self._meta = ConnectorMetadata()
        self._loading: Dict[str, Set[int]] = {}         # in the DecodeScheduler -> ranks that reported
        self._aborting: Dict[str, Set[int]] = {}        # ranks whose aborted result is due
        self._settling: Dict[str, Tuple[Any, Set[int]]] = {}  # an outcome held until these ranks stopped
        self._saving: Dict[str, Set[int]] = {}          # ranks still storing the request
        self._held: Set[str] = set()                    # held for decode readers
        self._early_params: Dict[str, Dict[str, Any]] = {}
        self._streaming: Dict[str, StreamSpec] = {}
        self._early_events: Dict[str, List[Any]] = {}  # readers' events before request_finished (streamed)
        self._done = FinishedRequests()

    # -- handshake

    def set_xfer_handshake_metadata(self, metadata: Union[Mapping[int, str], Sequence[str]]) -> None:
        """The side channel address of each rank of this instance (WorkerConnector.get_handshake_metadata()),
        by rank or in rank order: what decode instances are told to read from."""
        addresses = [metadata[r] for r in sorted(metadata)] if isinstance(metadata, Mapping) else list(metadata)
        if len(addresses) != self.config.tp_size:
            raise _fail(f"{len(addresses)} rank addresses for an instance of tp_size {self.config.tp_size}")
        self._addresses = [str(a) for a in addresses]

    # -- the four scheduler hooks

    def get_num_new_matched_tokens(self, request_id: str, prompt_token_ids: Any, num_computed_tokens: int,
                                   kv_transfer_params: Optional[Mapping[str, Any]] = None) -> Tuple[int, bool]:
        """(tokens beyond num_computed_tokens the connector will load, whether the load is
        asynchronous). Decode with a prefill's params: the whole rest of the prompt,
        asynchronously. Else the prefix store's hit, loaded in the step's start_load_kv."""
        request_id = str(request_id)
        tokens = _tokens(prompt_token_ids)
        params = dict(kv_transfer_params) if kv_transfer_params else None
        hit = 0
        if self._lookup is not None:
            limit = len(tokens) - 1 if self.config.lookup_keep_last_token else len(tokens)
            hit = self._lookup.lookup(tokens, limit_tokens=max(limit, 0)).hit_tokens
        if params and params.get("do_remote_decode") and self.config.produces:
            self._decode_ranks_of(request_id, params)  # refused now, not at request_finished
        self._pending[request_id] = _Pending(tokens, num_computed_tokens, params, hit)
        if params and params.get("do_remote_prefill"):
            if not self.config.consumes:
                raise _fail(f"request '{request_id}': kv_transfer_params ask to load from a prefill instance, "
                            f"but this instance's role is '{self.config.role}'")
            for key in ("remote_instance", "remote_addresses", "remote_block_ids", "remote_num_tokens"):
                if key not in params:
                    raise _fail(f"request '{request_id}': kv_transfer_params lack '{key}'")
            remote_tokens = int(params["remote_num_tokens"])
            return max(remote_tokens - num_computed_tokens, 0), remote_tokens > num_computed_tokens
        return max(hit - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request_id: str, block_ids: BlockIds, num_external_tokens: int) -> None:
        """The engine allocated the request's blocks (its whole block table): record the load
        (and, for a prefill that streams, the announcement) for the next build_connector_meta()."""
        request_id = str(request_id)
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        blocks = _plain_blocks(block_ids)
        params = p.params or {}
        if params.get("do_remote_prefill"):
            # Always a load, even of no token: the read (or its absence) tells prefill to free.
            n = int(params["remote_num_tokens"])
            store_end = p.store_hit if p.store_hit > p.computed else 0
            self._meta.loads.append(LoadSpec(
                request_id, blocks, n, skip_tokens=min(p.computed, n), store_tokens=store_end,
                token_ids=p.tokens if store_end else None, remote_instance=str(params["remote_instance"]),
                remote_addresses=list(params["remote_addresses"]), remote_blocks=params["remote_block_ids"],
                remote_request_id=str(params.get("remote_request_id", request_id)),
                stream=bool(params.get("stream", self.config.stream))))
            self._decode.expect(request_id, skip_tokens=min(p.computed, n), timeout=self.config.load_timeout_s)
            self._loading[request_id] = set()
            self._pending[request_id] = dataclasses.replace(p, params=None)  # request_finished may store it
            return
        if num_external_tokens > 0 and p.store_hit > p.computed:
            self._meta.loads.append(LoadSpec(request_id, blocks, p.store_hit, skip_tokens=p.computed,
                                             store_tokens=p.store_hit, token_ids=p.tokens))
        if params.get("do_remote_decode") and params.get("stream_to") and self.config.produces:
            to = params["stream_to"]
            spec = StreamSpec(request_id, str(to["instance"]), list(to["addresses"]))
            self._streaming[request_id] = spec
            self._meta.streams.append(spec)
            self._early_params[request_id] = self._params_for(request_id, blocks, len(p.tokens), params)
        # Keep what request_finished needs.
        self._pending[request_id] = p

    def transfer_params(self, request_id: str) -> Optional[Dict[str, Any]]:
        """Prefill streaming to a decode instance: the kv_transfer_params the router may forward
        as soon as the blocks are allocated (decode then loads while prefill computes)."""
        return self._early_params.get(str(request_id))

    def build_connector_meta(self, finishing: Optional[Iterable[str]] = None) -> ConnectorMetadata:
        """The step's metadata for every worker. finishing: the streamed requests whose prefill
        ends in this step (chunked prefill); None: all of them."""
        meta, self._meta = self._meta, ConnectorMetadata()
        ending = None if finishing is None else {str(r) for r in finishing}
        meta.streams = [dataclasses.replace(s, finishes=ending is None or s.request_id in ending)
                        for s in meta.streams]
        for rid, spec in self._streaming.items():
            if ending is not None and rid in ending and all(s.request_id != rid for s in meta.streams):
                meta.streams.append(dataclasses.replace(spec, finishes=True))
        return meta

    def request_finished(self, request_id: str, block_ids: BlockIds, aborted: bool = False,
                         num_tokens: Optional[int] = None) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """The request ended in the engine. Returns (delay_free, kv_transfer_params):
        delay_free True means the engine keeps its blocks until the request appears in
        take_finished().finished_sending. Prefill (do_remote_decode): the blocks are held for
        the decode readers and the params name them; a stored prefix is saved first."""
        request_id = str(request_id)
        p = self._pending.pop(request_id, None)
        self._early_params.pop(request_id, None)
        self._streaming.pop(request_id, None)
        early_events = self._early_events.pop(request_id, [])
        if request_id in self._loading:  # decode: still loading; the blocks are free once every rank stopped
            reported = self._loading.pop(request_id)
            try:
                self._decode.abort(request_id)
            except _kvb.NotFound:
                pass  # settled already: its outcome is dropped with it
            due = set(range(self.config.tp_size)) - reported
            if not due:
                return False, None
            self._aborting[request_id] = due
            self._meta.aborts.append(request_id)
            return True, None
        for i, load in enumerate(self._meta.loads):  # not handed to the workers yet
            if load.request_id == request_id:
                if load.remote_instance is None:
                    del self._meta.loads[i]
                else:  # nothing to read, but the prefill must hear that its blocks are free
                    self._meta.loads[i] = dataclasses.replace(load, skip_tokens=load.num_tokens, store_tokens=0,
                                                              token_ids=None, stream=False)
                    self._aborting[request_id] = set(range(self.config.tp_size))
                    self._decode.abort(request_id)
                    return True, None
                break
        if aborted or p is None:
            return False, None
        blocks = _plain_blocks(block_ids)
        n = len(p.tokens) if num_tokens is None else int(num_tokens)
        delay = False
        params_out = None
        params = p.params or {}
        if params.get("do_remote_decode") and self.config.produces:
            readers = self._decode_ranks_of(request_id, params)
            now = time.monotonic()
            self._prefill.hold(request_id, readers, now=now)
            self._held.add(request_id)
            for event in early_events:
                self._prefill.on_reader_event(event, now)
            params_out = self._params_for(request_id, blocks, n, params)
            delay = True
        if self.config.has_store and self.config.store_save and n >= self.config.store_hash_block_tokens:
            self._meta.saves.append(SaveSpec(request_id, p.tokens, n, blocks))
            self._saving[request_id] = set(range(self.config.tp_size))
            delay = True
        return delay, params_out

    # -- what the workers said

    def update_connector_output(self, outputs: Iterable[WorkerOutput], now: Optional[float] = None) -> None:
        """Takes each rank's WorkerOutput (build_connector_worker_meta()) of the step."""
        now = time.monotonic() if now is None else now
        for out in outputs:
            for event in out.reader_events:
                if event.request in self._streaming:  # read while prefill still runs it: held later
                    self._early_events.setdefault(event.request, []).append(event)
                else:
                    self._prefill.on_reader_event(event, now)
            for result in out.load_results:
                rid = result.request
                if rid in self._settling:
                    outcome, due = self._settling[rid]
                    due.discard(out.rank)
                    if not due:
                        del self._settling[rid]
                        self._done.finished_recving.add(rid)
                        self._done.outcomes[rid] = outcome
                elif rid in self._aborting:
                    self._aborting[rid].discard(out.rank)
                    if not self._aborting[rid]:
                        del self._aborting[rid]
                        self._done.finished_sending.add(rid)
                elif rid in self._loading and out.rank not in self._loading[rid]:
                    self._loading[rid].add(out.rank)
                    self._decode.rank_result(out.rank, result)
            for rid in list(out.saved) + list(out.save_errors):
                ranks = self._saving.get(rid)
                if ranks is not None:
                    ranks.discard(out.rank)
                    if not ranks:
                        del self._saving[rid]
                        if rid not in self._held:
                            self._done.finished_sending.add(rid)

    def rank_lost(self, rank: int, why: str) -> None:
        """A rank of this instance is gone: every load waiting on it fails naming it (a lost rank
        writes nothing more, so nothing waits for its result)."""
        self._decode.rank_lost(rank, _kvb.Status("unavailable", why))
        for reported in self._loading.values():
            reported.add(rank)
        for rid, due in list(self._aborting.items()):
            due.discard(rank)
            if not due:
                del self._aborting[rid]
                self._done.finished_sending.add(rid)
        for rid, (outcome, due) in list(self._settling.items()):
            due.discard(rank)
            if not due:
                del self._settling[rid]
                self._done.finished_recving.add(rid)
                self._done.outcomes[rid] = outcome

    def take_finished(self, now: Optional[float] = None) -> FinishedRequests:
        """What ended since the last call (each request once)."""
        now = time.monotonic() if now is None else now
        for release in self._prefill.take_releases(now):
            self._held.discard(release.request)
            if release.request not in self._saving:
                self._done.finished_sending.add(release.request)
        for outcome in self._decode.take_outcomes(now):
            reported = self._loading.pop(outcome.request, set())
            due = set(range(self.config.tp_size)) - reported
            if due and outcome.outcome != "aborted":
                # Past its deadline while ranks still load: reported once they stopped writing.
                self._settling[outcome.request] = (outcome, due)
                self._meta.aborts.append(outcome.request)
                continue
            self._done.finished_recving.add(outcome.request)
            self._done.outcomes[outcome.request] = outcome
        done, self._done = self._done, FinishedRequests()
        return done

    @property
    def held(self) -> int:
        """Requests whose blocks are held for decode readers."""
        return self._prefill.held

    # -- helpers

    def _decode_ranks_of(self, request_id: str, params: Mapping[str, Any]) -> int:
        n = params.get("decode_ranks", self.config.decode_ranks)
        if n is None:
            raise _fail(f"request '{request_id}': how many decode ranks read it is unknown: give "
                        f"kv_transfer_params['decode_ranks'] (the router knows the decode instance) or "
                        f"ConnectorConfig.decode_ranks")
        return int(n)

    def _params_for(self, request_id: str, blocks: Any, n: int, params: Mapping[str, Any]) -> Dict[str, Any]:
        if not self._addresses:
            raise _fail("the rank addresses are unknown: call set_xfer_handshake_metadata() first")
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_instance": self.config.instance_id,
                "remote_addresses": list(self._addresses), "remote_block_ids": blocks, "remote_num_tokens": n,
                "remote_request_id": request_id, "remote_tp_size": self.config.tp_size,
                "stream": bool(params.get("stream_to"))}


# ---------------------------------------------------------------------------- worker half


class WorkerConnector:
    """The worker half: one per rank, in the rank's process. Its methods may be called from
    the rank's threads (the C++ worker does the network work on its own threads)."""

    def __init__(self, config: ConnectorConfig, rank: int) -> None:
        if not 0 <= rank < config.tp_size:
            raise _fail(f"rank {rank} of an instance of tp_size {config.tp_size}")
        self.config = config
        self.rank = rank
        self.engine: Optional["_kvb.Engine"] = None
        self.worker: Optional["_kvb.ConnectorWorker"] = None
        self.store: Optional["_kvb.RankStore"] = None
        self._layout: Optional["_kvb.Layout"] = None
        self._meta = ConnectorMetadata()
        self._remotes: Dict[str, List[str]] = {}
        self._loads: Dict[str, LoadSpec] = {}      # asynchronous loads under way, by the id they load under
        self._load_ids: Dict[str, str] = {}        # the engine's request id -> the id it loads under
        self._streams: Set[str] = set()            # prefill: requests announced layer by layer
        self._lock = threading.Lock()
        self._out = WorkerOutput(rank)
        self._recving: Set[str] = set()
        self._sending: Set[str] = set()
        self._bad_blocks: Set[int] = set()
        self._saves: List[SaveSpec] = []

    # -- registration

    def register_kv_caches(self, kv_caches: Mapping[str, Any], spec: Optional[Mapping[str, Any]] = None
                           ) -> "_kvb.Layout":
        """Registers the rank's caches: {layer name: tensor}, each laid out as
        ConnectorConfig.cache_layout says ("flash_attn": [2 (K, V), blocks, block_size, heads,
        head_size]; "flash_infer": [blocks, 2, block_size, heads, head_size]; "mla": [blocks,
        block_size, dim], replicated over the ranks), in ConnectorConfig.groups ({group:
        {"layers": [names], "kind", "window_tokens", ...}}; default: one attention group
        "full" of every layer). spec: a layout_from_tensors() spec instead, for any other
        layout. Starts the rank's Engine and ConnectorWorker; returns the layout."""
        if self.worker is not None:
            raise _fail("register_kv_caches() was called already")
        if spec is None:
            spec = self._spec_of(kv_caches)
        self._layout = layout_from_tensors(spec)
        names = self._layout.tensor_names
        tensors = dict(spec["tensors"]) if isinstance(spec["tensors"], Mapping) else None
        memory = [tensors[n] for n in names] if tensors is not None else spec["tensors"]
        c = self.config
        self.engine = _kvb.Engine(name=f"{c.instance_id}/r{self.rank}", host=c.host, secret=c.secret,
                                  advertise_host=c.advertise_host, faults=c.engine_faults)
        try:
            self.worker = _kvb.ConnectorWorker(
                self.engine, self._layout, memory, instance_id=c.instance_id, side_channel_host=c.host,
                side_channel_advertise_host=c.advertise_host, secret=c.secret,
                handshake_timeout=c.handshake_timeout_s, transfer_timeout=c.load_timeout_s,
                verify_plans=c.verify_plans, remote_access="read" if c.produces else "none",
                load_chunk_tokens=c.load_chunk_tokens)
            if c.has_store:
                self.store = _kvb.RankStore(_store_for(c), self._layout, memory)
        except BaseException:
            self.close()
            raise
        return self._layout

    @property
    def layout(self) -> "_kvb.Layout":
        if self._layout is None:
            raise _fail("register_kv_caches() has not been called")
        return self._layout

    def get_handshake_metadata(self) -> str:
        """This rank's side channel address, for SchedulerConnector.set_xfer_handshake_metadata()."""
        return self._require().side_channel_address

    # -- per step

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = ConnectorMetadata()

    def start_load_kv(self) -> None:
        """Starts the step's loads (the prefix-store part here and now, the P/D part queued on
        the worker's threads: this never waits on the network), aborts, saves and streams."""
        w = self._require()
        for rid in self._meta.aborts:
            with self._lock:
                wid = self._load_ids.get(rid, rid)
            try:
                w.abort(wid)
            except _kvb.NotFound:
                pass  # its result is in already, or it never started here: it is reported either way
        for load in self._meta.loads:
            self._start(load)
        for s in self._meta.streams:
            self._stream(s)
        with self._lock:
            self._saves.extend(self._meta.saves)
        self._run_saves()

    def wait_for_layer_load(self, layer_name: str, request_ids: Optional[Iterable[str]] = None) -> None:
        """Returns once `layer_name` of each streamed load of request_ids (default: those the
        bound metadata starts) has landed, or the load ended; a failure arrives as the load's
        result. A request not loading streamed returns at once."""
        w = self._require()
        if request_ids is None:
            request_ids = [load.request_id for load in self._meta.loads if load.stream]
        with self._lock:
            ids = [self._load_ids[str(r)] for r in request_ids
                   if str(r) in self._load_ids and self._loads[self._load_ids[str(r)]].stream]
        for rid in ids:
            try:
                w.wait_for_layer(rid, layer_name, timeout=self.config.load_timeout_s)
            except _kvb.Error:
                pass  # the load's LoadResult says what went wrong

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None) -> None:
        """Prefill: `layer_name` is written for the step's requests: announces it for every
        streamed request whose prefill ends in this step (the layer's bytes are final)."""
        w = self._require()
        for s in self._meta.streams:
            if s.finishes:
                w.save_layer(s.request_id, layer_name)

    def wait_for_save(self) -> None:
        """Prefill: returns once each decode rank acknowledged the step's streamed layers;
        runs the pending prefix-store saves."""
        w = self._require()
        for s in self._meta.streams:
            if s.finishes:
                try:
                    w.wait_for_save(s.request_id, timeout=self.config.load_timeout_s)
                except _kvb.Error:
                    pass  # the decode side reports the load's failure
                with self._lock:
                    self._streams.discard(s.request_id)
        self._run_saves()

    # -- what ended

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> Tuple[Set[str], Set[str]]:
        """(requests this rank finished storing, requests whose load ended on this rank) since
        the last call. The prefill holds are decided by the scheduler half from the readers'
        events (build_connector_worker_meta())."""
        self._poll()
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Local block ids whose KV did not arrive (from the first token that did not), since
        the last call: the engine recomputes them (or fails the request)."""
        self._poll()
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def build_connector_worker_meta(self) -> WorkerOutput:
        """This rank's results and readers' events since the last call, for the scheduler half's
        update_connector_output()."""
        self._poll()
        with self._lock:
            out, self._out = self._out, WorkerOutput(self.rank)
        return out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> "WorkerConnector":
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()

    # -- internals

    def _require(self) -> "_kvb.ConnectorWorker":
        if self.worker is None:
            raise _fail("register_kv_caches() has not been called (or the connector is closed)")
        return self.worker

    def _spec_of(self, kv_caches: Mapping[str, Any]) -> Dict[str, Any]:
        c = self.config
        if not kv_caches:
            raise _fail("no caches given")
        groups = c.groups or {"full": {"layers": list(kv_caches)}}
        spec_groups: Dict[str, Any] = {}
        seen: Set[str] = set()
        for gname, g in groups.items():
            layers = {}
            for lname in g["layers"]:
                if lname not in kv_caches:
                    raise _fail(f"group '{gname}' names layer '{lname}', which is not among the caches")
                seen.add(lname)
                t = kv_caches[lname]
                if c.cache_layout == "flash_attn":
                    if len(t.shape) != 5 or t.shape[0] != 2:
                        raise _fail(f"layer '{lname}': shape {tuple(t.shape)} is not flash_attn's "
                                    f"[2, blocks, block_size, heads, head_size]")
                    layers[lname] = {"k": t[0], "v": t[1]}
                elif c.cache_layout == "flash_infer":
                    if len(t.shape) != 5 or t.shape[1] != 2:
                        raise _fail(f"layer '{lname}': shape {tuple(t.shape)} is not flash_infer's "
                                    f"[blocks, 2, block_size, heads, head_size]")
                    layers[lname] = {"k": t[:, 0], "v": t[:, 1]}
                else:
                    if len(t.shape) != 3:
                        raise _fail(f"layer '{lname}': shape {tuple(t.shape)} is not mla's [blocks, block_size, dim]")
                    layers[lname] = {"kv": (t, "block position cell")}
            entry = {k: v for k, v in g.items() if k != "layers"}
            entry["layers"] = layers
            spec_groups[gname] = entry
        missing = [n for n in kv_caches if n not in seen]
        if missing:
            raise _fail(f"layers {missing} are in no group of ConnectorConfig.groups")
        spec: Dict[str, Any] = {"model": c.model, "tp_size": c.tp_size, "tp_rank": self.rank,
                                "tensors": dict(kv_caches), "groups": spec_groups,
                                "dims": "block position head cell"}
        if c.num_kv_heads is not None and c.cache_layout != "mla":
            spec["heads"] = {"total": c.num_kv_heads}
        return spec

    def _group_blocks(self, blocks: Any, what: str) -> Dict[str, List[int]]:
        groups = [g.name for g in self.layout.groups]
        if isinstance(blocks, Mapping):
            unknown = [g for g in blocks if g not in groups]
            if unknown:
                raise _fail(f"{what}: unknown group(s) {unknown} (the layout's: {groups})")
            return {g: list(ids) for g, ids in blocks.items()}
        items = list(blocks)
        if items and isinstance(items[0], list):
            if len(items) != len(groups):
                raise _fail(f"{what}: {len(items)} block lists for the layout's {len(groups)} groups {groups}")
            return dict(zip(groups, items))
        if len(groups) != 1:
            raise _fail(f"{what}: a flat block list for a layout of {len(groups)} groups {groups}: give one per group")
        return {groups[0]: items}

    def _start(self, load: LoadSpec) -> None:
        w = self._require()
        rid = load.request_id
        have = load.skip_tokens
        try:
            local = self._group_blocks(load.local_blocks, f"request '{rid}' local blocks")
            if load.store_tokens > have and self.store is not None and load.token_ids is not None:
                end = min(load.store_tokens, load.num_tokens) if load.remote_instance else load.store_tokens
                got = self.store.get(load.token_ids, _kvb.Request(end, {g: (ids, []) for g, ids in local.items()},
                                                                  skip_tokens=have))
                have = max(have, min(got.hit_tokens, end))
            if load.remote_instance is None:
                if have < load.store_tokens:  # the store delivered less than its lookup promised
                    self._mark_bad(local, have, load.store_tokens)
                return
            remote = self._group_blocks(load.remote_blocks, f"request '{rid}' remote blocks")
            instance = load.remote_instance
            if instance not in self._remotes:
                w.add_remote(instance, list(load.remote_addresses or []))
                self._remotes[instance] = list(load.remote_addresses or [])
                w.connect(instance)
            blocks = {g: (ids, remote.get(g, [])) for g, ids in local.items()}
            with self._lock:
                self._loads[load.load_id] = dataclasses.replace(load, skip_tokens=have)
                self._load_ids[rid] = load.load_id
            w.start_load(load.load_id, instance,
                         _kvb.Request(load.num_tokens, blocks, skip_tokens=min(have, load.num_tokens)),
                         stream=load.stream)
        except _kvb.Error as e:
            if load.remote_instance is None:
                raise
            with self._lock:
                self._loads.pop(load.load_id, None)
                self._load_ids.pop(rid, None)
                self._out.load_results.append(_kvb.LoadResult(rid, _kvb.Status(e.code, str(e)), first_bad_token=have))
                self._recving.add(rid)
            try:
                self._mark_bad(self._group_blocks(load.local_blocks, "blocks"), have, load.num_tokens)
            except _kvb.Error:
                pass  # the block lists themselves are what is wrong: the result says so

    def _stream(self, s: StreamSpec) -> None:
        w = self._require()
        if s.instance not in self._remotes:
            w.add_remote(s.instance, s.addresses)
            self._remotes[s.instance] = s.addresses
        with self._lock:
            first = s.request_id not in self._streams
            self._streams.add(s.request_id)
        if first:
            w.stream_to(s.request_id, s.instance)

    def _run_saves(self) -> None:
        with self._lock:
            saves, self._saves = self._saves, []
        for s in saves:
            try:
                local = self._group_blocks(s.local_blocks, f"request '{s.request_id}' blocks")
                if self.store is not None:
                    self.store.put(s.token_ids, _kvb.Request(s.num_tokens, {g: (ids, []) for g, ids in local.items()}))
                with self._lock:
                    self._out.saved.append(s.request_id)
                    self._sending.add(s.request_id)
            except _kvb.Error as e:
                with self._lock:
                    self._out.save_errors[s.request_id] = str(e)
                    self._sending.add(s.request_id)

    def _poll(self) -> None:
        if self.worker is None:
            return
        self._run_saves()
        results = self.worker.take_results()
        events = self.worker.take_reader_events()
        for r in results:
            with self._lock:
                load = self._loads.pop(r.request, None)
                if load is not None:
                    self._load_ids.pop(load.request_id, None)
                    r.request = load.request_id  # the engine's id
                self._out.load_results.append(r)
                self._recving.add(r.request)
            if not r.ok and load is not None:
                self._mark_bad(self._group_blocks(load.local_blocks, "blocks"), max(r.first_bad_token, load.skip_tokens),
                               load.num_tokens)
        with self._lock:
            self._out.reader_events.extend(events)

    def _mark_bad(self, local: Mapping[str, List[int]], first_bad: int, num_tokens: int) -> None:
        """The local blocks holding tokens [first_bad, num_tokens) (every block of a group that
        cannot resume part way: sliding window, state, scratch, context-sharded)."""
        bad: Set[int] = set()
        for g in self.layout.groups:
            ids = local.get(g.name, [])
            if g.kind == "attention" and not g.context.sharded():
                bt = max(g.block_tokens, 1)
                bad.update(b for b in ids[first_bad // bt:-(-num_tokens // bt)] if b >= 0)
            else:
                bad.update(b for b in ids if b >= 0)
        with self._lock:
            self._bad_blocks |= bad


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

import collections
import dataclasses
import hashlib
import hmac
import json
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
    decode_ranks: not configured any more: the prefill holds a handed-off request until every
      rank of the decode instance that reads it said done, and the readers say how many they
      are (their instance's layout decides it). Giving it is refused, naming this.
    lease_s: how long prefill holds a request's blocks without a heartbeat from a reader.
    heartbeat_s: how often a decode rank's heartbeat renews the holds of what it reads (below
      lease_s, or every slow load would lose its blocks).
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
      passed to each rank's Engine and ConnectorWorker; transports: the Engine's (None: every
      one available, the closest first).
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
    heartbeat_s: float = 1.0
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
    transports: Optional[Tuple[str, ...]] = None
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
        if not 0 < self.heartbeat_s < self.lease_s:
            raise _fail(f"heartbeat_s {self.heartbeat_s} (expected more than 0 and less than lease_s "
                        f"{self.lease_s}: a reader renews its hold before it expires)")
        if self.decode_ranks is not None:
            raise _fail(f"decode_ranks {self.decode_ranks}: the number of decode ranks that read a request is not "
                        f"configured; the readers say it (their instance's layout decides it), so leave it out")

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


_MAX_BLOCK_ID = (1 << 63) - 1


def _torch_cuda_device(tensors: Any) -> Optional[Any]:
    """The device of the first torch CUDA tensor among `tensors` (a list or a dict), when torch's
    CUDA runtime is there to record events on it; None otherwise (host memory, or device memory
    that did not come from torch)."""
    items = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    for t in items:
        device = getattr(t, "device", None)
        if getattr(device, "type", None) != "cuda" or not hasattr(t, "is_cuda") or not t.is_cuda:
            continue
        try:
            import torch
            if torch.cuda.is_available():
                return device
        except Exception:
            return None
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_block_ids(request_id: str, what: str, blocks: Any) -> None:
    """Block ids as kv_transfer_params carry them (a list, a list per group, {group: ids}): ints
    from -1 (a block that moves nothing) up; anything else is refused here, by name."""
    lists = list(blocks.values()) if isinstance(blocks, Mapping) else [blocks]
    if lists and isinstance(blocks, Sequence) and blocks and not _is_int(blocks[0]):
        lists = list(blocks)
    for ids in lists:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise _fail(f"request '{request_id}': {what} must be lists of block ids, not {type(ids).__name__}")
        for b in ids:
            if not _is_int(b) or not -1 <= b <= _MAX_BLOCK_ID:
                raise _fail(f"request '{request_id}': {what} holds {b!r}, not a block id (-1 or 0..2^63-1)")


def _check_request_id(request_id: Any, what: str) -> str:
    rid = str(request_id)
    if not rid or len(rid) > 256 or any(not 0x20 < ord(c) < 0x7f for c in rid):
        raise _fail(f"{what} {rid[:40]!r} is not a request id (1 to 256 bytes of printable ASCII without spaces)")
    return rid


# What a hand-off's MAC covers: everything a decode instance reads by (where, which blocks, how
# many tokens, under which request id and incarnation).
_HANDOFF_FIELDS = ("remote_instance", "remote_addresses", "remote_incarnations", "remote_block_ids",
                   "remote_num_tokens", "remote_request_id", "remote_tp_size", "stream")
# Hand-offs a decode instance remembers having loaded (a second request naming one is refused).
_MAX_HANDOFFS_SEEN = 65536


def _handoff_mac(secret: str, params: Mapping[str, Any]) -> str:
    """HMAC-SHA256 under the deployment's secret over a hand-off's fields (canonical JSON)."""
    try:
        body = json.dumps({k: params.get(k) for k in _HANDOFF_FIELDS}, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _fail(f"kv_transfer_params hold a value that is not plain data ({e})") from None
    return hmac.new(secret.encode(), b"kvbridge.handoff/1\0" + body.encode(), hashlib.sha256).hexdigest()


def _check_params(request_id: str, params: Mapping[str, Any], prompt_tokens: int, secret: str = "") -> int:
    """A prefill's kv_transfer_params as a decode instance receives them (through a router, which
    may forward what a client sent): each value is checked before anything uses it, and under a
    secret the hand-off must carry the prefill's MAC over it. Returns remote_num_tokens."""
    for key in ("remote_instance", "remote_addresses", "remote_block_ids", "remote_num_tokens"):
        if key not in params:
            raise _fail(f"request '{request_id}': kv_transfer_params lack '{key}'")
    n = params["remote_num_tokens"]
    if not _is_int(n) or not 0 <= n <= prompt_tokens:
        raise _fail(f"request '{request_id}': remote_num_tokens {n!r} is not a token count of its "
                    f"{prompt_tokens}-token prompt")
    instance = params["remote_instance"]
    if not isinstance(instance, str) or not instance or any(not c.isprintable() or c.isspace() for c in instance):
        raise _fail(f"request '{request_id}': remote_instance {instance!r} is not an instance id")
    addresses = params["remote_addresses"]
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence) or not addresses or \
            not all(isinstance(a, str) for a in addresses):
        raise _fail(f"request '{request_id}': remote_addresses {addresses!r} is not a list of host:port")
    _check_block_ids(request_id, "remote_block_ids", params["remote_block_ids"])
    if "remote_request_id" in params:
        _check_request_id(params["remote_request_id"], f"request '{request_id}': remote_request_id")
    incarnations = params.get("remote_incarnations")
    if incarnations is not None:
        if isinstance(incarnations, (str, bytes)) or not isinstance(incarnations, Sequence) or \
                len(incarnations) != len(addresses) or \
                not all(isinstance(i, str) and len(i) == 16 and all(c in "0123456789abcdef" for c in i)
                        for i in incarnations):
            raise _fail(f"request '{request_id}': remote_incarnations {incarnations!r} is not one incarnation "
                        f"(16 hex digits) per remote address")
    if secret:
        # The prefill signed what it handed off; a router or client without the secret cannot
        # point a load at other blocks, another request, other addresses or more tokens.
        mac = params.get("remote_mac")
        if not isinstance(mac, str):
            raise _kvb.PermissionDenied(f"connector_v1: request '{request_id}': kv_transfer_params carry no "
                                        f"remote_mac, and this instance holds the deployment's secret")
        if not hmac.compare_digest(mac, _handoff_mac(secret, params)):
            raise _kvb.PermissionDenied(f"connector_v1: request '{request_id}': kv_transfer_params are not the "
                                        f"hand-off instance '{instance}' signed under this instance's secret "
                                        f"(remote_mac does not match them: changed on the way, or the two "
                                        f"instances hold different secrets)")
    return n


def _addresses(ranks: Iterable[Any]) -> List[str]:
    """Side channel addresses from what ranks said (HandshakeMetadata, or the address itself)."""
    return [r.address if isinstance(r, HandshakeMetadata) else str(r) for r in ranks]


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
    # Prefill: requests whose held blocks the engine frees now: each rank says so to its readers
    # before anything can write those blocks again (a read that may have seen the next owner fails).
    released: List[str] = dataclasses.field(default_factory=list)
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
        self._incarnations: List[str] = []
        self._prefill = _kvb.PrefillScheduler(lease=config.lease_s)
        self._decode = _kvb.DecodeScheduler(ranks=config.tp_size, policy=config.failure_policy)
        self._pending: Dict[str, _Pending] = {}
        # Hand-offs loaded here, oldest first: (instance, its request id, incarnations) -> request.
        self._handoffs: "collections.OrderedDict[Tuple[str, str, Tuple[str, ...]], str]" = collections.OrderedDict()
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
        self._streamed: Set[str] = set()  # decode: loads streamed in

    # -- handshake

    def set_xfer_handshake_metadata(self, metadata: Union[Mapping[int, Any], Sequence[Any]]) -> None:
        """Each rank's WorkerConnector.get_handshake_metadata() (a HandshakeMetadata, or a side channel
        address), by rank or in rank order: what decode instances are told to read from. With the
        ranks' incarnations the hand-off names them, so a restarted rank is never read as the one
        that held the request. Called again after a rank restarted."""
        ranks = [metadata[r] for r in sorted(metadata)] if isinstance(metadata, Mapping) else list(metadata)
        if len(ranks) != self.config.tp_size:
            raise _fail(f"{len(ranks)} rank addresses for an instance of tp_size {self.config.tp_size}")
        self._addresses = [m.address if isinstance(m, HandshakeMetadata) else str(m) for m in ranks]
        incarnations = [m.incarnation if isinstance(m, HandshakeMetadata) else "" for m in ranks]
        self._incarnations = incarnations if all(incarnations) else []

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
        self._pending[request_id] = _Pending(tokens, num_computed_tokens, params, hit)
        if params and params.get("do_remote_prefill"):
            if not self.config.consumes:
                raise _fail(f"request '{request_id}': kv_transfer_params ask to load from a prefill instance, "
                            f"but this instance's role is '{self.config.role}'")
            remote_tokens = _check_params(request_id, params, len(tokens), self.config.secret)
            self._claim_handoff(request_id, params)
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
                remote_incarnations=list(params["remote_incarnations"]) if params.get("remote_incarnations") else None,
                stream=bool(params.get("stream", self.config.stream))))
            self._decode.expect(request_id, skip_tokens=min(p.computed, n), timeout=self.config.load_timeout_s)
            self._loading[request_id] = set()
            if self._meta.loads[-1].stream:
                self._streamed.add(request_id)
            self._pending[request_id] = dataclasses.replace(p, params=None)  # request_finished may store it
            return
        if num_external_tokens > 0 and p.store_hit > p.computed:
            self._meta.loads.append(LoadSpec(request_id, blocks, p.store_hit, skip_tokens=p.computed,
                                             store_tokens=p.store_hit, token_ids=p.tokens))
        if params.get("do_remote_decode") and params.get("stream_to") and self.config.produces:
            to = params["stream_to"]
            spec = StreamSpec(request_id, str(to["instance"]), _addresses(to["addresses"]))
            self._streaming[request_id] = spec
            self._meta.streams.append(spec)
            self._early_params[request_id] = self._params_for(request_id, blocks, len(p.tokens), params)
        # Keep what request_finished needs.
        self._pending[request_id] = p

    def transfer_params(self, request_id: str) -> Optional[Dict[str, Any]]:
        """Prefill streaming to a decode instance: the kv_transfer_params the router may forward
        as soon as the blocks are allocated (decode then loads while prefill computes)."""
        return self._early_params.get(str(request_id))

    def build_connector_meta(self, finishing: Optional[Iterable[str]] = None,
                             scheduled: Optional[Iterable[str]] = None) -> ConnectorMetadata:
        """The step's metadata for every worker. finishing: the streamed requests whose prefill
        ends in this step (chunked prefill); None: all of them. scheduled: the requests the step's
        batch computes; those whose KV still streams in are the only ones wait_for_layer_load()
        waits for (None: none, so a load never stalls the batch)."""
        meta, self._meta = self._meta, ConnectorMetadata()
        if scheduled is not None:
            streaming = {load.request_id for load in meta.loads if load.stream}
            streaming |= {rid for rid in self._loading if rid in self._streamed}
            meta.computes = [str(r) for r in scheduled if str(r) in streaming]
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
        streamed = self._streaming.pop(request_id, None) is not None
        early_events = self._early_events.pop(request_id, [])
        self._streamed.discard(request_id)
        # Not handed to the workers yet: nothing may move, whatever raced with what. The load
        # becomes one of no token (the prefill still hears that its blocks are free).
        for i, load in enumerate(self._meta.loads):
            if load.request_id != request_id:
                continue
            if load.remote_instance is None:
                del self._meta.loads[i]
                break
            self._meta.loads[i] = dataclasses.replace(load, skip_tokens=load.num_tokens, store_tokens=0,
                                                      token_ids=None, stream=False)
            self._loading.pop(request_id, None)
            self._aborting[request_id] = set(range(self.config.tp_size))
            try:
                self._decode.abort(request_id)
            except _kvb.NotFound:
                pass
            return True, None
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
        if aborted and streamed and self.config.produces:
            # Prefill, streamed to a decode instance that may be reading its layers now: the
            # blocks are held until the readers heard from are done (their lease, or a grace
            # when none was heard), then freed and said so to the readers.
            now = time.monotonic()
            self._prefill.hold(request_id, now=now)
            self._held.add(request_id)
            for event in early_events:
                self._prefill.on_reader_event(event, now)
            try:
                self._prefill.abort(request_id, now=now)
            except _kvb.NotFound:
                pass  # every reader was done already: released as read
            return True, None
        if aborted or p is None:
            return False, None
        blocks = _plain_blocks(block_ids)
        n = len(p.tokens) if num_tokens is None else int(num_tokens)
        delay = False
        params_out = None
        params = p.params or {}
        if params.get("do_remote_decode") and self.config.produces:
            now = time.monotonic()
            self._prefill.hold(request_id, now=now)  # until every reader said done: they say how many they are
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
            # Every rank says so to its readers in the next step, before the engine can give the
            # blocks to another request: a read that may see the next owner's bytes then fails.
            self._meta.released.append(release.request)
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

    def _params_for(self, request_id: str, blocks: Any, n: int, params: Mapping[str, Any]) -> Dict[str, Any]:
        if not self._addresses:
            raise _fail("the rank addresses are unknown: call set_xfer_handshake_metadata() first")
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_instance": self.config.instance_id,
               "remote_addresses": list(self._addresses), "remote_block_ids": blocks, "remote_num_tokens": n,
               "remote_request_id": request_id, "remote_tp_size": self.config.tp_size,
               "stream": bool(params.get("stream_to"))}
        if self._incarnations:
            out["remote_incarnations"] = list(self._incarnations)
        if self.config.secret:
            out["remote_mac"] = _handoff_mac(self.config.secret, out)
        return out

    def _claim_handoff(self, request_id: str, params: Mapping[str, Any]) -> None:
        """One hand-off is loaded by one request: a second request naming the same prefill request
        of the same instance (a replay of params seen elsewhere) is refused, naming the first."""
        key = (str(params["remote_instance"]), str(params.get("remote_request_id", request_id)),
               tuple(params.get("remote_incarnations") or params["remote_addresses"]))
        owner = self._handoffs.get(key)
        if owner is not None and owner != request_id:
            raise _kvb.PermissionDenied(f"connector_v1: request '{request_id}': the hand-off of request "
                                        f"'{key[1]}' of instance '{key[0]}' is request '{owner}''s, loaded "
                                        f"already")
        self._handoffs[key] = request_id
        while len(self._handoffs) > _MAX_HANDOFFS_SEEN:
            self._handoffs.popitem(last=False)


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
        self._unsaved: Set[str] = set()             # prefill: streams whose announcements are not all acknowledged
        self._unsaved_next = 0.0                     # when _check_unsaved() looks next
        self._layer_events: Dict[str, Any] = {}    # prefill, CUDA caches: one interprocess event per layer
        self._cuda_device: Optional[Any] = None     # the caches' torch device when they are CUDA tensors

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
                                  advertise_host=c.advertise_host, faults=c.engine_faults,
                                  transports=list(c.transports) if c.transports else None)
        try:
            self.worker = _kvb.ConnectorWorker(
                self.engine, self._layout, memory, instance_id=c.instance_id, side_channel_host=c.host,
                side_channel_advertise_host=c.advertise_host, secret=c.secret,
                handshake_timeout=c.handshake_timeout_s, transfer_timeout=c.load_timeout_s,
                heartbeat_interval=c.heartbeat_s,
                verify_plans=c.verify_plans, remote_access="read" if c.produces else "none",
                load_chunk_tokens=c.load_chunk_tokens)
            if c.has_store:
                self.store = _kvb.RankStore(_store_for(c), self._layout, memory)
            self._cuda_device = _torch_cuda_device(memory)
        except BaseException:
            self.close()
            raise
        return self._layout

    @property
    def layout(self) -> "_kvb.Layout":
        if self._layout is None:
            raise _fail("register_kv_caches() has not been called")
        return self._layout

    def get_handshake_metadata(self) -> HandshakeMetadata:
        """This rank's side channel address and incarnation, for
        SchedulerConnector.set_xfer_handshake_metadata()."""
        w = self._require()
        return HandshakeMetadata(w.side_channel_address, w.incarnation)

    # -- per step

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = ConnectorMetadata()

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        """Starts the step's loads (the prefix-store part here and now, the P/D part queued on
        the worker's threads), aborts, saves and streams. Never waits on the network and never
        raises: every failure arrives as a load's result. First it tells the readers of the
        blocks the engine freed (ConnectorMetadata.released), before this step's forward pass can
        write them. A load that the same metadata aborts moves nothing (its prefill is still told).
        With CUDA caches, the reads into them wait on the device for the work the current stream
        has queued (the blocks' previous owner)."""
        w = self._require()
        meta = self._meta
        for rid in meta.released:
            w.blocks_released(rid)
        aborting = set(meta.aborts)
        ready = self._consumer_ready()
        for load in meta.loads:
            if load.request_id in aborting:
                load = dataclasses.replace(load, skip_tokens=load.num_tokens, store_tokens=0, token_ids=None,
                                           stream=False)
            self._start(load, ready)
        for rid in meta.aborts:
            with self._lock:
                wid = self._load_ids.get(rid, rid)
            try:
                w.abort(wid)
            except _kvb.NotFound:
                pass  # its result is in already, or it never started here: it is reported either way
            except Exception as e:  # a cancel that could not be confirmed: its result says so
                with self._lock:
                    self._out.save_errors.setdefault(rid, f"abort: {e}")
        for s in meta.streams:
            self._stream(s)
        with self._lock:
            self._saves.extend(meta.saves)
        self._run_saves()

    def wait_for_layer_load(self, layer_name: str, request_ids: Optional[Iterable[str]] = None) -> None:
        """Returns once `layer_name` of each streamed load of the requests the step's batch
        computes has landed, or the load ended (a failure arrives as its result). The requests
        are request_ids, or the bound metadata's `computes` (build_connector_meta(scheduled=)):
        a load the batch does not compute never holds the step up."""
        w = self._require()
        if request_ids is None:
            request_ids = self._meta.computes
        with self._lock:
            ids = [self._load_ids[str(r)] for r in request_ids
                   if str(r) in self._load_ids and self._loads[self._load_ids[str(r)]].stream]
        for rid in ids:
            try:
                w.wait_for_layer(rid, layer_name, timeout=self.config.load_timeout_s)
            except Exception:
                pass  # the load's LoadResult says what went wrong

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None,
                      ready: Any = None, **kwargs: Any) -> None:
        """Prefill: the kernels that write `layer_name` for the step's requests are queued (or
        done): announces it for every streamed request whose prefill ends in this step. Readers
        read it once it is written: with CUDA caches this records an interprocess event (one per
        layer, recorded again each step) on the current stream of kv_layer's device, which the
        readers' copies wait on; `ready` gives one instead (a torch.cuda.Event made interprocess,
        or an IPC event handle as bytes). Never raises: a failed announcement is reported in
        WorkerOutput.stream_errors, and the readers' loads fail by their deadline."""
        w = self._require()
        finishing = [s for s in self._meta.streams if s.finishes]
        if not finishing:
            return
        try:
            event = ready if ready is not None else self._producer_ready(layer_name, kv_layer)
        except Exception as e:
            event, failed = None, f"layer '{layer_name}': recording its ready event failed: {e}"
            with self._lock:
                for s in finishing:
                    self._out.stream_errors.setdefault(s.request_id, failed)
            return
        for s in finishing:
            try:
                w.save_layer(s.request_id, layer_name, ready=event)
            except Exception as e:
                with self._lock:
                    self._out.stream_errors.setdefault(s.request_id, str(e))

    def wait_for_save(self) -> None:
        """Prefill: runs the pending prefix-store saves, and notes which streamed requests' layer
        announcements every decode rank acknowledged. Never waits on the network: announcements
        not acknowledged yet are looked at again next step, and a failure is reported in
        WorkerOutput.stream_errors (the decode side reports its load's failure)."""
        self._require()
        with self._lock:
            for s in self._meta.streams:
                if s.finishes:
                    self._unsaved.add(s.request_id)
        self._check_unsaved()
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

    def _start(self, load: LoadSpec, ready: Any = None) -> None:
        """One load of the step. Every failure becomes the load's result (P/D) or its blocks'
        load error (a store-only load): nothing raises out of the engine's step."""
        w = self._require()
        rid = load.request_id
        have = load.skip_tokens
        try:
            local = self._group_blocks(load.local_blocks, f"request '{rid}' local blocks")
            if load.store_tokens > have and self.store is not None and load.token_ids is not None:
                end = min(load.store_tokens, load.num_tokens) if load.remote_instance else load.store_tokens
                try:
                    got = self.store.get(load.token_ids, _kvb.Request(end, {g: (ids, []) for g, ids in local.items()},
                                                                      skip_tokens=have))
                    have = max(have, min(got.hit_tokens, end))
                except _kvb.Error:
                    pass  # the store delivered nothing: read from prefill instead, or recompute
            if load.remote_instance is None:
                if have < load.store_tokens:  # the store delivered less than its lookup promised
                    self._mark_bad(local, have, load.store_tokens)
                return
            remote = self._group_blocks(load.remote_blocks, f"request '{rid}' remote blocks")
            instance = load.remote_instance
            addresses = list(load.remote_addresses or [])
            if instance not in self._remotes:
                w.add_remote(instance, addresses)
                self._remotes[instance] = addresses
                w.connect(instance)
            blocks = {g: (ids, remote.get(g, [])) for g, ids in local.items()}
            with self._lock:
                self._loads[load.load_id] = dataclasses.replace(load, skip_tokens=have)
                self._load_ids[rid] = load.load_id
            w.start_load(load.load_id, instance,
                         _kvb.Request(load.num_tokens, blocks, skip_tokens=min(have, load.num_tokens)),
                         stream=load.stream, ready=ready, incarnations=load.remote_incarnations,
                         addresses=addresses)
        except Exception as e:
            status = _kvb.Status(e.code, str(e)) if isinstance(e, _kvb.Error) else \
                _kvb.Status("internal", f"{type(e).__name__}: {e}")
            with self._lock:
                self._loads.pop(load.load_id, None)
                self._load_ids.pop(rid, None)
                self._out.load_results.append(_kvb.LoadResult(rid, status, first_bad_token=have))
                self._recving.add(rid)
            try:
                self._mark_bad(self._group_blocks(load.local_blocks, "blocks"), have,
                               load.num_tokens if load.remote_instance else load.store_tokens)
            except Exception:
                pass  # the block lists themselves are what is wrong: the result says so

    def _stream(self, s: StreamSpec) -> None:
        """Prefill: the decode instance a request streams to. Never waits on the network (the
        handshake runs on the worker's connect thread) and never raises."""
        w = self._require()
        try:
            if self._remotes.get(s.instance) != list(s.addresses):
                w.add_remote(s.instance, list(s.addresses))
                self._remotes[s.instance] = list(s.addresses)
            with self._lock:
                first = s.request_id not in self._streams
                self._streams.add(s.request_id)
            if first:
                w.stream_to(s.request_id, s.instance)
        except Exception as e:
            with self._lock:
                self._out.stream_errors.setdefault(s.request_id, str(e))

    def _check_unsaved(self) -> None:
        """Streams whose announcements every decode rank acknowledged (or that failed) are done
        with; the others are looked at again later. Never waits; one call into the worker for
        them all, at most every few milliseconds (a silent decode instance leaves many pending)."""
        w = self.worker
        now = time.monotonic()
        if w is None or now < self._unsaved_next:
            return
        self._unsaved_next = now + 0.005
        with self._lock:
            pending = list(self._unsaved)
        if not pending:
            return
        ended = w.poll_saves(pending)
        with self._lock:
            for rid, status in ended.items():
                if not status.ok and status.code != "not_found":  # not found: forgotten after its deadline
                    self._out.stream_errors.setdefault(rid, status.message)
                self._unsaved.discard(rid)
                self._streams.discard(rid)

    def _cuda_caches(self) -> Optional[Any]:
        """The torch device of the registered caches when they are torch CUDA tensors (events are
        recorded on its current stream); None for host memory, or without torch's CUDA."""
        return self._cuda_device

    def _consumer_ready(self) -> Any:
        """An event after the work queued on the current stream (the blocks' previous owner):
        the step's reads into CUDA caches wait for it on the device. None for host caches."""
        device = self._cuda_caches()
        if device is None:
            return None
        import torch  # only with CUDA caches, which came from torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _producer_ready(self, layer_name: str, kv_layer: Any) -> Any:
        """The interprocess event of `layer_name`, recorded on the current stream of the layer's
        device (after the kernels that write it): what its readers wait on. None for host caches.
        One event per layer, recorded again each step: a reader waits for its latest record,
        which is never earlier than the one its announcement follows."""
        device = self._cuda_caches()
        if device is None:
            return None
        import torch
        if kv_layer is not None and getattr(getattr(kv_layer, "device", None), "type", None) == "cuda":
            device = kv_layer.device
        event = self._layer_events.get(layer_name)
        if event is None:
            event = torch.cuda.Event(interprocess=True)
            self._layer_events[layer_name] = event
        event.record(torch.cuda.current_stream(device))
        return event

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
            except Exception as e:
                with self._lock:
                    self._out.save_errors[s.request_id] = str(e)
                    self._sending.add(s.request_id)

    def _poll(self) -> None:
        if self.worker is None:
            return
        self._run_saves()
        self._check_unsaved()
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
            # An aborted load's blocks are the engine's to free, not to recompute.
            if not r.ok and not r.aborted and load is not None:
                self._mark_bad(self._group_blocks(load.local_blocks, "blocks"), max(r.first_bad_token, load.skip_tokens),
                               load.num_tokens)
        with self._lock:
            self._out.reader_events.extend(events)

    def _mark_bad(self, local: Mapping[str, List[int]], first_bad: int, num_tokens: int) -> None:
        """The local blocks holding tokens [first_bad, num_tokens) (every block of a group that
        cannot resume part way: sliding window, state, scratch, context-sharded); only ids of
        blocks the group has (-1 and ids past its blocks name nothing to recompute)."""
        bad: Set[int] = set()
        for g in self.layout.groups:
            ids = list(local.get(g.name, []))
            if g.kind == "attention" and not g.context.sharded():
                bt = max(g.block_tokens, 1)
                ids = ids[first_bad // bt:-(-num_tokens // bt)]
            bad.update(b for b in ids if _is_int(b) and 0 <= b < g.num_blocks)
        with self._lock:
            self._bad_blocks |= bad

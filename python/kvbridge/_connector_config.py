"""kvbridge.connector_v1's configuration (ConnectorConfig), the prefix stores one process shares,
and the checks of what crosses an instance's boundary: block ids, request ids, and a prefill's
kv_transfer_params with their MAC. Private: kvbridge.connector_v1 re-exports the public names."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import threading
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from . import _kvbridge as _kvb

ROLES = ("prefill", "decode", "both")
CACHE_LAYOUTS = ("flash_attn", "flash_infer", "mla")


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
    load_timeout_s: decode: a load not ended by then fails, naming why (each rank ends its own
      load by then; a rank that reports nothing 2 s later is reported silent).
    store_hash_block_tokens: 0 for no prefix store; else its hash block (tokens), with
      store_memory_bytes of memory tier per process and store_redis ("host:port") as the
      shared tier (needed for hits across processes). store_save: store finished requests.
    lookup_keep_last_token: a prefix-store lookup leaves the last prompt token to compute
      (the engine needs its logits).
    stream: decode: load layer by layer, as the prefill saves each (the prefill must stream
      to this instance: kv_transfer_params "stream_to").
    read_grants: prefill: a decode rank may read only the blocks of the requests handed off to
      it (kv_transfer_params), from its first heartbeat for the request until the blocks are
      freed; a read of anything else is refused. Enforced where the prefill serves the reads
      itself (tcp); over local, cma and ucx the reader reaches the memory directly.
    verify_content: check every byte moved end to end (xxh3 at the source and where it landed):
      a load whose bytes differ fails naming the piece. Reads every byte again (device memory
      on the device).
    host, advertise_host, secret, handshake_timeout_s, verify_plans, load_chunk_tokens:
      passed to each rank's Engine and ConnectorWorker; transports: the Engine's (None: every
      one available, the closest first).
    engine_faults: for tests only: fault injection into each rank's Engine, which is then made by
      kvbridge.testing.engine_with_faults(engine_faults, ...) ("": a plain kvbridge.Engine).
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
    verify_content: bool = False
    read_grants: bool = True
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

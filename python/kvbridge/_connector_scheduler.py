"""kvbridge.connector_v1's scheduler half (SchedulerConnector). Private: kvbridge.connector_v1
re-exports it."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from . import _kvbridge as _kvb
from ._connector_config import ConnectorConfig, _MAX_HANDOFFS_SEEN, _check_params, _fail, _handoff_mac, _store_for
from ._connector_meta import (BlockIds, ConnectorMetadata, FinishedRequests, HandshakeMetadata, LoadSpec, SaveSpec,
                              StreamSpec, WorkerOutput)

# Each decode rank ends its own load by load_timeout_s after it starts it (naming why: a read
# refused, a source silent), a step or more after the scheduler allocated the blocks; the
# scheduler waits this much longer for the ranks' outcomes before it reports a rank silent.
_RANK_RESULT_GRACE_S = 2.0


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
            self._decode.expect(request_id, skip_tokens=min(p.computed, n), timeout=self.config.load_timeout_s + _RANK_RESULT_GRACE_S)
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
            self._meta.hand_offs[request_id] = blocks
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
            if not streamed:  # a streamed request was handed off when its blocks were allocated
                self._meta.hand_offs[request_id] = blocks
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
            self._meta.released_readers[release.request] = list(release.readers_done)
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

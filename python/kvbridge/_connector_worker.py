"""kvbridge.connector_v1's worker half (WorkerConnector). Private: kvbridge.connector_v1
re-exports it."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from . import _kvbridge as _kvb
from ._connector_config import ConnectorConfig, _fail, _is_int, _store_for, _torch_cuda_device
from ._connector_meta import ConnectorMetadata, HandshakeMetadata, LoadSpec, SaveSpec, StreamSpec, WorkerOutput
from ._layout_builder import layout_from_tensors


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
        engine_kwargs: Dict[str, Any] = dict(name=f"{c.instance_id}/r{self.rank}", host=c.host, secret=c.secret,
                                             advertise_host=c.advertise_host,
                                             transports=list(c.transports) if c.transports else None)
        if c.engine_faults:  # tests only: an engine whose transports misbehave as engine_faults says
            self.engine = _kvb.testing.engine_with_faults(c.engine_faults, **engine_kwargs)
        else:
            self.engine = _kvb.Engine(**engine_kwargs)
        try:
            self.worker = _kvb.ConnectorWorker(
                self.engine, self._layout, memory, instance_id=c.instance_id, side_channel_host=c.host,
                side_channel_advertise_host=c.advertise_host, secret=c.secret,
                handshake_timeout=c.handshake_timeout_s, transfer_timeout=c.load_timeout_s,
                heartbeat_interval=c.heartbeat_s,
                verify_plans=c.verify_plans, verify_content=c.verify_content,
                remote_access=("granted_read" if c.read_grants else "read") if c.produces else "none",
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
        for rid, blocks in meta.hand_offs.items():
            try:
                w.hand_off(rid, self._group_blocks(blocks, f"request '{rid}' handed-off blocks"))
            except Exception as e:  # its readers' reads are refused, and their loads fail naming why
                with self._lock:
                    self._out.hand_off_errors.setdefault(rid, str(e))
        for rid in meta.released:
            w.blocks_released(rid, meta.released_readers.get(rid, []))
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
                                                                      skip_tokens=have), ready=ready)
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
        """An event after the work queued on the current stream: the step's reads into CUDA
        caches wait for it on the device (the blocks' previous owner), the prefix store's gets
        and puts on the host (what still reads or writes their blocks). None for host caches."""
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
        # With CUDA caches the puts read them after the work queued so far on the current stream
        # (the kernels that wrote the requests' KV).
        ready = self._consumer_ready() if saves and self.store is not None else None
        for s in saves:
            try:
                local = self._group_blocks(s.local_blocks, f"request '{s.request_id}' blocks")
                if self.store is not None:
                    self.store.put(s.token_ids, _kvb.Request(s.num_tokens, {g: (ids, []) for g, ids in local.items()}),
                                   ready=ready)
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

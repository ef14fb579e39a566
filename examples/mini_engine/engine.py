#!/usr/bin/python3
"""The mini engine: a real transformer served prefill/decode-disaggregated through
kvbridge.connector_v1, its output compared with a colocated run.

Each instance (prefill, decode) is one process per TP rank, the ranks joined by a gloo
process group (the head outputs' all-gather, and the scheduler's step broadcast). Rank 0
of each instance also runs the instance's scheduler half. The parent process is the
router: it sends a prompt to prefill, gets back the first token and the kv_transfer_params,
and forwards them to decode, which loads the KV through kvbridge and generates the rest
greedily. The check: the generated tokens and every logit (bit for bit) equal those of a
colocated run (one rank, prefill and decode in one process, no transfer).

  PYTHONPATH=build/python /usr/bin/python3 examples/mini_engine/engine.py \\
      --model llama --prefill-tp 2 --decode-tp 4 --prefill-block 16 --decode-block 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import MODELS, ModelConfig, RankModel  # noqa: E402


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    role: str                 # "prefill" or "decode"
    tp: int
    block_size: int
    num_blocks: int = 32
    order: str = "layer"      # cache order: "layer" (per-layer tensors) or "block" (one block-major tensor)
    policy: str = "fail"      # decode: on a failed load, "fail" or "recompute"
    chunk: int = 0            # prefill: tokens per step (chunked prefill); 0: the whole prompt in one step
    store_redis: Optional[str] = None  # the prefix store's Redis ("host:port"): hits across the instances' processes
    lease_s: float = 20.0     # prefill: how long blocks wait for a reader that went silent
    load_timeout_s: float = 10.0
    secret: str = "mini-engine"
    layout_model: Optional[str] = None  # the model name in the layout (None: the model's): a mismatch is refused
    engine_faults: str = ""   # fault injection into the ranks' engines (kvbridge.testing.engine_with_faults)


# ---------------------------------------------------------------------------- one rank


class Rank:
    """One rank's part of an instance: its model shard, its connector worker, the collectives."""

    def __init__(self, cfg: ModelConfig, spec: InstanceSpec, rank: int, rendezvous: str) -> None:
        import torch.distributed as dist
        from kvbridge import connector_v1

        self.dist = dist
        self.spec, self.rank = spec, rank
        # A file, not a TCP port: a port picked free can be taken by another
        # process before the first rank binds it.
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=spec.tp)
        self.model = RankModel(cfg, spec.tp, rank, spec.block_size, spec.num_blocks, spec.order)
        self.config = connector_v1.ConnectorConfig(
            instance_id=spec.role, role=spec.role, tp_size=spec.tp, model=cfg.name,
            num_kv_heads=cfg.kv_heads if cfg.kind == "llama" else None, failure_policy=spec.policy,
            lease_s=spec.lease_s, load_timeout_s=spec.load_timeout_s, handshake_timeout_s=3.0, verify_plans=True,
            verify_content=True,
            store_hash_block_tokens=16 if spec.store_redis else 0, store_redis=spec.store_redis,
            store_memory_bytes=64 << 20, secret=spec.secret, engine_faults=spec.engine_faults)
        self.worker = connector_v1.WorkerConnector(self.config, rank)
        layout = self.model.layout_spec()
        if spec.layout_model:
            layout["model"] = spec.layout_model
        self.layout = self.worker.register_kv_caches(self.model.caches, spec=layout)
        self.addresses = self.all_gather(self.worker.get_handshake_metadata())

    def all_gather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.spec.tp
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_heads(self, mine: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(mine) for _ in range(self.spec.tp)]
        self.dist.all_gather(parts, mine)
        return torch.cat(parts)

    def step(self, meta: Any, compute: Optional[Tuple[List[int], int, Dict[str, List[int]]]]) -> Dict[str, Any]:
        """One engine step on this rank: the connector's hooks around the forward pass."""
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv()
        logits: List[torch.Tensor] = []
        if compute is not None:
            tokens, start, table = compute
            logits = self.model.forward(tokens, start, table, self.gather_heads,
                                        on_layer_done=lambda i: w.save_kv_layer(f"layers.{i}"))
        w.wait_for_save()
        w.clear_connector_metadata()
        return {"output": w.build_connector_worker_meta(), "bad_blocks": sorted(w.get_block_ids_with_load_errors()),
                "logits": logits}

    def close(self) -> None:
        self.worker.close()
        self.dist.destroy_process_group()


# ---------------------------------------------------------------------------- one instance


class Allocator:
    """Block pools per group; a request's blocks are {group: [ids]}."""

    def __init__(self, pools: Dict[str, int]) -> None:
        self.free = {g: list(range(n - 1, -1, -1)) for g, n in pools.items()}
        self.total = sum(pools.values())

    def take(self, wanted: Dict[str, int]) -> Dict[str, List[int]]:
        for g, k in wanted.items():
            if k > len(self.free[g]):
                raise RuntimeError(f"out of '{g}' blocks: {k} wanted, {len(self.free[g])} free")
        return {g: [self.free[g].pop() for _ in range(k)] for g, k in wanted.items()}

    def give(self, blocks: Dict[str, List[int]]) -> None:
        for g, ids in blocks.items():
            self.free[g].extend(ids)

    @property
    def used(self) -> int:
        return self.total - sum(len(f) for f in self.free.values())


def instance_main(cfg: ModelConfig, spec: InstanceSpec, rank: int, rendezvous: str, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    r = Rank(cfg, spec, rank, rendezvous)
    try:
        if rank == 0:
            Leader(r, inbox, outbox).run()
        else:
            while True:
                cmd = r.broadcast(None)
                if cmd is None:
                    break
                r.all_gather(r.step(*cmd))
    finally:
        r.close()


class Leader:
    """Rank 0: the instance's scheduler half and its loop; every other rank follows its steps."""

    def __init__(self, r: Rank, inbox: Any, outbox: Any) -> None:
        from kvbridge import connector_v1

        self.r, self.inbox, self.outbox = r, inbox, outbox
        self.scheduler = connector_v1.SchedulerConnector(r.config, layout=r.layout)
        self.scheduler.set_xfer_handshake_metadata(r.addresses)
        self.alloc = Allocator(r.model.pool_sizes())
        self.keep: Dict[str, List[int]] = {}  # blocks the connector still uses, by request
        self.finished: Any = connector_v1.FinishedRequests()
        self.store_tokens: Dict[str, int] = {}  # tokens each request's load takes from the prefix store
        self.deferred: List[Any] = []  # messages that came while a request was being served
        self.outbox.put(("ready", r.spec.role, r.addresses))

    def step(self, compute=None, finishing=None) -> List[Dict[str, Any]]:
        meta = self.scheduler.build_connector_meta(finishing)
        for load in meta.loads:
            self.store_tokens[load.request_id] = max(load.store_tokens - load.skip_tokens, 0)
        self.r.broadcast((meta, compute))
        results = self.r.all_gather(self.r.step(meta, compute))
        self.scheduler.update_connector_output([x["output"] for x in results])
        done = self.scheduler.take_finished()
        for rid in done.finished_sending:
            self.alloc.give(self.keep.pop(rid, []))
            self.outbox.put(("freed", rid))
        self.finished.finished_recving |= done.finished_recving
        self.finished.outcomes.update(done.outcomes)
        return results

    def run(self) -> None:
        while True:
            try:
                msg = self.deferred.pop(0) if self.deferred else self.inbox.get(timeout=0.005 if self.keep else 0.2)
            except queue.Empty:
                if self.keep:
                    self.step()
                continue
            if msg[0] == "stop":  # graceful: what the connector still does (saves, reads) ends first
                deadline = time.monotonic() + 10
                while self.keep and time.monotonic() < deadline:
                    self.step()
                    time.sleep(0.005)
                self.r.broadcast(None)
                self.outbox.put(("stopped", self.r.spec.role, self.alloc.used))
                return
            try:
                if msg[0] == "prefill":
                    self.prefill(*msg[1:])
                elif msg[0] == "decode":
                    self.decode(*msg[1:])
                elif msg[0] == "colocated":
                    self.colocated(*msg[1:])
            except Exception as e:  # reported to the router, the instance keeps serving
                self.outbox.put(("error", msg[1], f"{type(e).__name__}: {e}"))

    def compute(self, rid: str, tokens: List[int], start: int, table: Dict[str, List[int]], chunk: int,
                last_finishes: bool) -> torch.Tensor:
        """Runs tokens from position start, in steps of `chunk` tokens; the last step's last logits."""
        chunk = chunk or len(tokens)
        logits = None
        for a in range(0, len(tokens), chunk):
            part = tokens[a:a + chunk]
            final = a + chunk >= len(tokens)
            results = self.step((part, start + a, table), finishing=[rid] if final and last_finishes else [])
            logits = results[0]["logits"][-1]
        return logits

    def prefill(self, rid: str, prompt: List[int], params: Dict[str, Any]) -> None:
        n_ext, _ = self.scheduler.get_num_new_matched_tokens(rid, prompt, 0, params)
        table = self.alloc.take(self.r.model.blocks_for(len(prompt)))
        self.scheduler.update_state_after_alloc(rid, table, n_ext)
        early = self.scheduler.transfer_params(rid)
        if early is not None:  # streamed: decode may load while this instance computes
            self.outbox.put(("early", rid, early))
        t0 = time.monotonic()
        logits = self.compute(rid, prompt[n_ext:], n_ext, table, self.r.spec.chunk, True)
        delay, out = self.scheduler.request_finished(rid, table)
        if delay:
            self.keep[rid] = table
        else:
            self.alloc.give(table)
        self.outbox.put(("prefilled", rid, int(torch.argmax(logits)), logits, out,
                         {"prefill_s": time.monotonic() - t0, "store_tokens": self.store_tokens.pop(rid, 0)}))

    def decode(self, rid: str, prompt: List[int], first: Optional[int], params: Dict[str, Any], new_tokens: int,
               corrupt: bool = False) -> None:
        """Loads the request's KV, then generates from `first` (None: a streamed load started
        before the prefill finished; the first token follows as a ("first", rid, token) message)."""
        import kvbridge  # in the instance's process, like the connector
        t0 = time.monotonic()
        try:
            n, _ = self.scheduler.get_num_new_matched_tokens(rid, prompt, 0, params)
        except kvbridge.Error as e:  # params this instance cannot take: the request is refused
            code = getattr(e, "code", "") or re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).lower()
            self.outbox.put(("failed", rid, "refused", code, str(e)))
            return
        table = self.alloc.take(self.r.model.blocks_for(len(prompt) + new_tokens))
        self.scheduler.update_state_after_alloc(rid, table, n)
        deadline = time.monotonic() + 30
        while rid not in self.finished.finished_recving:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid}: no load outcome within 30 s")
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                msg = None
            if msg is not None and msg[0] == "first" and msg[1] == rid:  # streamed: prefill finished
                first = msg[2]
            elif msg is not None and msg[0] != "abort":
                self.deferred.append(msg)  # another request's: after this one
            if msg is not None and msg[0] == "abort" and msg[1] == rid:  # the client went away mid-load
                delay, _ = self.scheduler.request_finished(rid, table)
                if delay:
                    self.keep[rid] = table
                else:
                    self.alloc.give(table)
                self.outbox.put(("failed", rid, "aborted", "cancelled", f"request {rid} aborted while loading"))
                return
            self.step()
            time.sleep(0.002)
        self.finished.finished_recving.discard(rid)
        outcome = self.finished.outcomes.pop(rid)
        loaded_at = time.monotonic()
        loaded = loaded_at - t0
        recomputed = 0
        if outcome.outcome == "recompute":  # decode does the prefill's work from the first missing token
            recomputed = len(prompt) - outcome.recompute_from
            self.compute(rid, prompt[outcome.recompute_from:], outcome.recompute_from, table, 0, False)
        elif outcome.outcome != "finished":
            self.scheduler.request_finished(rid, table)
            self.alloc.give(table)
            self.outbox.put(("failed", rid, outcome.outcome, outcome.error.code, outcome.error.message))
            return
        if corrupt:  # the check's own check: one value of rank 0's loaded KV changed
            view = next(v for v in self.r.model.views if "k" in v or "c" in v)
            cell = view.get("k", view.get("c"))[table["full"][0], 0]
            cell += 1.0
        while first is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid}: no first token within 30 s")
            try:
                msg = self.inbox.get(timeout=0.005)
                if msg[0] == "first" and msg[1] == rid:
                    first = msg[2]
                else:
                    self.deferred.append(msg)
            except queue.Empty:
                self.step()
        tokens, logits, per_token = self.generate(first, len(prompt), table, new_tokens)
        delay, _ = self.scheduler.request_finished(rid, table)
        if delay:
            self.keep[rid] = table
        else:
            self.alloc.give(table)
        self.outbox.put(("decoded", rid, tokens, logits, {"load_s": loaded, "loaded_at": loaded_at,
                                                           "per_token_s": per_token,
                                                           "recomputed_tokens": recomputed,
                                                           "store_tokens": self.store_tokens.pop(rid, 0)}))

    def generate(self, first: int, at: int, table: Dict[str, List[int]], new_tokens: int
                 ) -> Tuple[List[int], List[torch.Tensor], float]:
        """Greedy decoding from token `first` at position `at`: the tokens (first included),
        each step's logits, the time per output token."""
        tokens, logits = [first], []
        t1 = time.monotonic()
        for i in range(new_tokens - 1):
            results = self.step(([tokens[-1]], at + i, table))
            logits.append(results[0]["logits"][-1])
            tokens.append(int(torch.argmax(logits[-1])))
        return tokens, logits, (time.monotonic() - t1) / max(new_tokens - 1, 1)

    def colocated(self, rid: str, prompt: List[int], new_tokens: int) -> None:
        """Prefill and decode on this instance, no transfer: the baseline of time per output token."""
        table = self.alloc.take(self.r.model.blocks_for(len(prompt) + new_tokens))
        try:
            first_logits = self.compute(rid, prompt, 0, table, 0, False)
            tokens, logits, per_token = self.generate(int(torch.argmax(first_logits)), len(prompt), table, new_tokens)
            logits.insert(0, first_logits)
        finally:
            self.alloc.give(table)
        self.outbox.put(("colocated", rid, tokens, logits, per_token))


# ---------------------------------------------------------------------------- colocated reference


def colocated(cfg: ModelConfig, prompt: List[int], new_tokens: int, block_size: int = 16) -> Tuple[List[int], List[torch.Tensor]]:
    """One rank, one process, no transfer: the tokens and the logits (the prefill's last, then
    one per decode step)."""
    m = RankModel(cfg, 1, 0, block_size, -(-(len(prompt) + new_tokens) // block_size), request_blocks=1)
    table = {g: list(range(n)) for g, n in m.blocks_for(len(prompt) + new_tokens).items()}
    logits = [m.forward(prompt, 0, table, lambda x: x)[-1]]
    tokens = [int(torch.argmax(logits[0]))]
    for i in range(new_tokens - 1):
        logits.append(m.forward([tokens[-1]], len(prompt) + i, table, lambda x: x)[-1])
        tokens.append(int(torch.argmax(logits[-1])))
    return tokens, logits


# ---------------------------------------------------------------------------- the router


class Cluster:
    """The processes of a prefill and a decode instance, and the router's side of their queues."""

    def __init__(self, cfg: ModelConfig, prefill: InstanceSpec, decode: InstanceSpec) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "kvbridge", "kvbridge.connector_v1", "model"])
        self.procs: Dict[str, List[Any]] = {}
        self.inbox: Dict[str, Any] = {}
        self.outbox: Dict[str, Any] = {}
        self.specs = {"prefill": prefill, "decode": decode}
        self.freed: set = set()
        # Each instance's ranks meet through a file of their own (removed by close()).
        self.rendezvous_dir = tempfile.mkdtemp(prefix="kvb-mini-engine-")
        for spec in (prefill, decode):
            rendezvous = os.path.join(self.rendezvous_dir, spec.role)
            self.inbox[spec.role], self.outbox[spec.role] = ctx.Queue(), ctx.Queue()
            self.procs[spec.role] = [
                ctx.Process(target=instance_main,
                            args=(cfg, spec, r, rendezvous, self.inbox[spec.role] if r == 0 else None,
                                  self.outbox[spec.role] if r == 0 else None),
                            name=f"{spec.role}/r{r}", daemon=True)
                for r in range(spec.tp)]
            for p in self.procs[spec.role]:
                p.start()
        self.addresses = {role: self.expect(role, "ready", timeout=120)[2] for role in ("prefill", "decode")}

    def expect(self, role: str, kind: str, timeout: float = 60) -> Tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.outbox[role].get(timeout=min(max(deadline - time.monotonic(), 0.01), 0.5))
            except queue.Empty:
                dead = [p for p in self.procs[role] if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{role}: process {dead[0].name} exited ({dead[0].exitcode})") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{role}: no '{kind}' within {timeout} s") from None
                continue
            if msg[0] == "freed" and kind != "freed":
                self.freed.add(msg[1])
                continue
            if msg[0] == "error":
                raise RuntimeError(f"{role}: request {msg[1]}: {msg[2]}")
            if msg[0] not in (kind, "failed"):
                raise RuntimeError(f"{role}: expected '{kind}', got {msg[:2]}")
            return msg

    def colocated(self, role: str, rid: str, prompt: List[int], new_tokens: int) -> Tuple[List[int], List[torch.Tensor], float]:
        """The request prefilled and decoded on one instance (no transfer): tokens, logits, time per token."""
        self.inbox[role].put(("colocated", rid, prompt, new_tokens))
        _, _, tokens, logits, per_token = self.expect(role, "colocated")
        return tokens, logits, per_token

    def wait_freed(self, rid: str, timeout: float) -> bool:
        """Whether the prefill freed the request's blocks within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while rid not in self.freed and time.monotonic() < deadline:
            try:
                m = self.outbox["prefill"].get(timeout=0.1)
                if m[0] == "freed":
                    self.freed.add(m[1])
            except queue.Empty:
                pass
        return rid in self.freed

    def kill(self, role: str) -> None:
        for p in self.procs[role]:
            p.kill()
        for p in self.procs[role]:
            p.join(10)

    def close(self) -> Dict[str, int]:
        """Stops both instances; the blocks each still held (0: nothing leaked)."""
        held = {}
        for role in ("decode", "prefill"):
            if all(p.is_alive() for p in self.procs[role]):
                self.inbox[role].put(("stop",))
                try:
                    msg = self.expect(role, "stopped", timeout=30)
                    held[role] = msg[2]
                except (TimeoutError, RuntimeError):
                    held[role] = -1
            for p in self.procs[role]:
                p.join(30)
                if p.is_alive():
                    p.kill()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
        return held


@dataclasses.dataclass
class RunResult:
    tokens: List[int]
    logits: List[torch.Tensor]
    failed: Optional[Tuple[str, str, str]] = None  # outcome, code, message
    ttft_s: float = 0.0
    per_token_s: float = 0.0
    recomputed_tokens: int = 0
    prefill_store_tokens: int = 0   # prompt tokens prefill took from the prefix store
    decode_store_tokens: int = 0    # ... and decode (the rest it read from prefill)
    prefill_freed: bool = False
    held: Optional[Dict[str, int]] = None


FAULTS = ("none", "kill-prefill", "kill-decode", "stall", "drop-done", "wrong-secret", "incompatible", "abort",
          "corrupt-kv")


def with_fault(prefill: InstanceSpec, decode: InstanceSpec, fault: str) -> Tuple[InstanceSpec, InstanceSpec]:
    """The instances' settings for a fault:
      kill-prefill  the prefill dies after handing the request over, before decode reads;
      kill-decode   decode dies right after it got the request: prefill frees at lease expiry;
      stall         every copy of decode's engines takes 3 s: the load times out (1 s);
      drop-done     decode's done messages are lost: prefill frees at lease expiry;
      wrong-secret  decode holds another secret: it refuses the prefill's hand-off (its MAC
                    does not match under decode's secret) before reading, so prefill frees
                    at lease expiry;
      incompatible  decode's layout names another model: refused, naming the field (the same);
      abort         the request is aborted while it loads (copies take 0.5 s): no byte lands late;
      corrupt-kv    decode changes one value it loaded: the check must see it."""
    if fault not in FAULTS:
        raise ValueError(f"fault '{fault}' (expected one of {', '.join(FAULTS)})")
    r = dataclasses.replace
    if fault in ("kill-decode", "drop-done", "wrong-secret", "incompatible"):
        prefill = r(prefill, lease_s=2.0)
    if fault == "drop-done":
        decode = r(decode, engine_faults="drop-done=1000")
    if fault == "stall":
        decode = r(decode, engine_faults="delay=3000", load_timeout_s=1.0)
    if fault == "abort":
        decode = r(decode, engine_faults="delay=500")
    if fault == "wrong-secret":
        decode = r(decode, secret="guessed")
    if fault == "incompatible":
        decode = r(decode, layout_model="another-model")
    return prefill, decode


def run_pd(cfg: ModelConfig, prefill: InstanceSpec, decode: InstanceSpec, prompt: List[int], new_tokens: int,
           fault: str = "none", cluster: Optional[Cluster] = None, rid: str = "req-1",
           stream: bool = False) -> RunResult:
    """One request through the cluster. fault: none; kill-prefill (the prefill instance dies
    after handing the request over, before decode reads its KV); corrupt-kv (decode changes
    one value of the KV it loaded: the output must differ, or the check checks nothing).
    stream: decode starts loading when prefill has allocated the blocks, and reads each layer
    as soon as prefill saved it."""
    own = cluster is None
    c = cluster or Cluster(cfg, prefill, decode)
    try:
        t0 = time.monotonic()
        to_prefill = {"do_remote_decode": True}
        if stream:
            to_prefill["stream_to"] = {"instance": decode.role, "addresses": c.addresses[decode.role]}
        c.inbox["prefill"].put(("prefill", rid, prompt, to_prefill))
        corrupt = fault == "corrupt-kv"
        if stream:
            _, _, early = c.expect("prefill", "early")
            c.inbox["decode"].put(("decode", rid, prompt, None, early, new_tokens, corrupt))
        _, _, first, last_logits, params, pinfo = c.expect("prefill", "prefilled")
        if fault == "kill-prefill":
            c.kill("prefill")
        if stream:
            c.inbox["decode"].put(("first", rid, first))
        else:
            c.inbox["decode"].put(("decode", rid, prompt, first, params, new_tokens, corrupt))
        if fault == "abort":
            time.sleep(0.1)
            c.inbox["decode"].put(("abort", rid))
        if fault == "kill-decode":
            time.sleep(0.05)
            c.kill("decode")
            res = RunResult([first], [last_logits], failed=("failed", "unavailable", "the decode instance died"))
            res.prefill_freed = c.wait_freed(rid, prefill.lease_s + 10)
            if own:
                res.held = c.close()
            return res
        msg = c.expect("decode", "decoded")
        if msg[0] == "failed":
            res = RunResult([first], [last_logits], failed=msg[2:])
            if fault not in ("kill-prefill",):
                res.prefill_freed = c.wait_freed(rid, prefill.lease_s + 10)
            if own:
                res.held = c.close()
            return res
        _, _, tokens, logits, info = msg
        # TTFT: admitted at prefill -> every decode rank holds all of its KV.
        res = RunResult(tokens, [last_logits] + logits, ttft_s=info["loaded_at"] - t0,
                        per_token_s=info["per_token_s"], recomputed_tokens=info["recomputed_tokens"],
                        prefill_store_tokens=pinfo["store_tokens"], decode_store_tokens=info["store_tokens"])
        if fault != "kill-prefill":
            res.prefill_freed = c.wait_freed(rid, prefill.lease_s + 10)
        if own:
            res.held = c.close()
        return res
    except BaseException:
        if own:
            c.close()
        raise


def compare(ref: Tuple[List[int], List[torch.Tensor]], got: RunResult) -> Optional[str]:
    """None when tokens and logits are identical bit for bit; else the first difference."""
    tokens, logits = ref
    for i, (a, b) in enumerate(zip(tokens, got.tokens)):
        if a != b:
            return f"token {i}: {b} (colocated {a})"
    if len(tokens) != len(got.tokens):
        return f"{len(got.tokens)} tokens (colocated {len(tokens)})"
    for i, (a, b) in enumerate(zip(logits, got.logits)):
        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            j = int((a.view(torch.int32) != b.view(torch.int32)).nonzero()[0])
            return f"logits of step {i} differ at {j}: {float(b[j])!r} (colocated {float(a[j])!r})"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="llama")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=4)
    ap.add_argument("--prefill-block", type=int, default=16)
    ap.add_argument("--decode-block", type=int, default=32)
    ap.add_argument("--prefill-order", choices=("layer", "block"), default="layer")
    ap.add_argument("--decode-order", choices=("layer", "block"), default="block")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=0, help="chunked prefill: tokens per step (0: one step)")
    ap.add_argument("--fault", choices=FAULTS, default="none", help="a fault to inject (see with_fault())")
    ap.add_argument("--policy", choices=("fail", "recompute"), default="fail")
    ap.add_argument("--stream", choices=("off", "layer"), default="off",
                    help="layer: also run the request streamed (decode reads each layer as prefill saves it) "
                         "and report TTFT with and without streaming")
    ap.add_argument("--repeat", type=int, default=3, help="--stream layer: requests of each kind (TTFT p50)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.stream != "off" and a.fault != "none":
        ap.error("--stream layer runs several requests; give it without --fault")
    cfg = ModelConfig(kind=a.model, seed=a.seed)
    g = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(0, cfg.vocab, (a.prompt_tokens,), generator=g).tolist()
    ref = colocated(cfg, prompt, a.new_tokens)
    blocks = lambda bs: 2 * (-(-(a.prompt_tokens + a.new_tokens) // bs)) + 2  # noqa: E731
    p = InstanceSpec("prefill", a.prefill_tp, a.prefill_block, blocks(a.prefill_block), a.prefill_order, chunk=a.chunk)
    d = InstanceSpec("decode", a.decode_tp, a.decode_block, blocks(a.decode_block), a.decode_order, policy=a.policy)
    p, d = with_fault(p, d, a.fault)
    cluster = Cluster(cfg, p, d)
    runs: List[Tuple[str, RunResult]] = []
    try:
        local_tpot: List[float] = []
        if a.stream == "off":
            runs.append(("req-1", run_pd(cfg, p, d, prompt, a.new_tokens, fault=a.fault, cluster=cluster)))
        else:  # a first request connects the instances; then unstreamed and streamed ones alternate
            run_pd(cfg, p, d, prompt, a.new_tokens, cluster=cluster, rid="warm-up")
            for i in range(a.repeat):
                for streamed in (False, True):
                    rid = f"req-{i}-{'stream' if streamed else 'whole'}"
                    runs.append((rid, run_pd(cfg, p, d, prompt, a.new_tokens, cluster=cluster, rid=rid,
                                             stream=streamed)))
                # The baseline: the same request prefilled and decoded on the decode instance itself.
                tokens, logits, per_token = cluster.colocated("decode", f"local-{i}", prompt, a.new_tokens)
                local = RunResult(tokens, logits, per_token_s=per_token)
                runs.append((f"local-{i}", local))
                local_tpot.append(per_token)
    finally:
        held = cluster.close()
    got = runs[0][1]
    diffs = {rid: ("request failed" if r.failed else compare(ref, r)) for rid, r in runs}
    diff = next((f"{rid}: {x}" for rid, x in diffs.items() if x is not None), None)

    def p50(xs: List[float]) -> float:
        return round(sorted(xs)[len(xs) // 2] * 1e3, 1)

    whole = [r.ttft_s for rid, r in runs if rid.endswith("whole")] or [runs[0][1].ttft_s]
    streamed = [r.ttft_s for rid, r in runs if rid.endswith("stream")]
    pd_tpot = [r.per_token_s for rid, r in runs if not rid.startswith("local")]
    report = {
        "model": cfg.name, "prefill": f"TP {p.tp}, {p.block_size}-token blocks, {p.order}-major",
        "decode": f"TP {d.tp}, {d.block_size}-token blocks, {d.order}-major", "prompt_tokens": a.prompt_tokens,
        "colocated_tokens": ref[0], "pd_tokens": got.tokens, "requests": len(runs), "identical": diff is None,
        "first_difference": diff, "failed": list(got.failed) if got.failed else None,
        "ttft_ms": p50(streamed) if streamed else p50(whole),
        "time_per_output_token_ms": p50(pd_tpot), "recomputed_tokens": got.recomputed_tokens,
        "prefill_blocks_freed": all(r.prefill_freed for rid, r in runs if not rid.startswith("local"))
                                or a.fault == "kill-prefill",
        "blocks_held_at_exit": held,
    }
    if streamed:
        report["ttft_no_stream_ms"] = p50(whole)
    if local_tpot:
        report["time_per_output_token_colocated_ms"] = p50(local_tpot)
    ok = expected(a.fault, a.policy, got, diff, held)
    report["as_expected"] = ok
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        fault = "" if a.fault == "none" else f", fault {a.fault} (policy {a.policy})"
        print(f"{cfg.name}: prefill {report['prefill']} -> decode {report['decode']}, {a.prompt_tokens}-token "
              f"prompt{fault}")
        print(f"colocated tokens: {ref[0]}")
        if got.failed:
            print(f"the request failed: {got.failed[0]} ({got.failed[1]}): {got.failed[2]}")
            print(f"prefill blocks freed: {report['prefill_blocks_freed']}")
        else:
            print(f"P/D tokens:       {got.tokens}")
            what = f"{len(runs)} requests: " if len(runs) > 1 else ""
            print(what + ("tokens and logits identical bit for bit" if diff is None else f"DIFFERENT: {diff}"))
        if got.failed:
            pass
        elif streamed:
            print(f"TTFT p50 streamed {report['ttft_ms']} ms, not streamed {report['ttft_no_stream_ms']} ms")
            tp, tl = report["time_per_output_token_ms"], report["time_per_output_token_colocated_ms"]
            print(f"time per output token p50: P/D {tp} ms, colocated on the decode instance {tl} ms "
                  f"({tp / tl:.2f}x)")
        else:
            print(f"TTFT {report['ttft_ms']} ms, time per output token {report['time_per_output_token_ms']} ms"
                  + (f", {got.recomputed_tokens} tokens recomputed on decode" if got.recomputed_tokens else ""))
        print(f"blocks held at exit: {held}")
        if a.fault != "none":
            print("as the fault should end" if ok else "NOT as the fault should end")
    return 0 if ok else 1


def expected(fault: str, policy: str, got: RunResult, diff: Optional[str], held: Dict[str, int]) -> bool:
    """Whether a run ended as its fault should: identical output, or a clear failure, and in
    every case no block left held by an instance that is still alive."""
    clean = all(v == 0 for v in held.values())
    if fault == "corrupt-kv":
        return diff is not None and clean
    recovers = fault in ("none", "drop-done") or (fault in ("kill-prefill", "stall") and policy == "recompute")
    if recovers:
        return diff is None and clean and (got.prefill_freed or fault == "kill-prefill")
    return got.failed is not None and clean and (got.prefill_freed or fault == "kill-prefill")


if __name__ == "__main__":
    sys.exit(main())

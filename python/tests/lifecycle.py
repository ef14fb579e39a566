#!/usr/bin/python3
"""Randomized request lifecycles through kvbridge.connector_v1: the hunt for wrong bytes reported
ok, late writes, early frees and stranded holds.

A world is one prefill instance and one decode instance (TP 1 or 2 each, real engines and
workers in this process, over the local or the tcp transport, host memory or the host fake's
device memory), driven step by step as an engine drives its connector: a scheduler half and a
worker half per rank, block pools, a router. Requests arrive and run their lifecycle; from the
world's seed, some are aborted at every stage (before the prefill hands them off, after the
decode allocated them but before the workers saw them, while loading, after they loaded), the
prefill and the decode instance restart, leases expire (short leases, slow reads, lost
heartbeats), producers are slow (device memory: each layer's copy lands behind a kernel, and is
announced at once with its event), and control messages are dropped and duplicated.

Invariants, checked with the deterministic content (kvbridge.fill_request / check_request):
  1. no load is reported finished with a wrong byte;
  2. no byte lands in a decode block after the engine was told its request ended (freed blocks
     are poisoned, and must stay poison until they are given out again);
  3. no prefill block is freed as read while a reader still reads it, and a reader whose blocks
     were freed under it (a lease that expired, an abort) never finishes ok;
  4. no prefill block is held past the load's deadline, its lease and a grace.

A failure prints its seed, and `lifecycle.py --seed S --lifecycles N` replays it.

Usage: PYTHONPATH=<build>/python KVB_DEVICE=fake /usr/bin/python3 python/tests/lifecycle.py
         [--seed S] [--lifecycles N] [--minutes M] [--worlds W [--jobs J]]
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

import kvbridge

from lifecycle_world import (  # the script's own directory is on sys.path
    DECODE_BLOCKS, GRACE_S, LAYERS, POISON, PREFILL_BLOCKS,
    Instance, Req, Violation, WorldConfig, device_fake,
)


class World:
    def __init__(self, cfg: WorldConfig, log: Any = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.log = log or (lambda *a: None)
        self.restarts = 0
        self.prefill_gen = 0
        self.decode_gen = 0
        self.prefill = Instance(self, "prefill", cfg.prefill_tp, 16, PREFILL_BLOCKS)
        self.decode = Instance(self, "decode", cfg.decode_tp, cfg.decode_block, DECODE_BLOCKS)
        self.reqs: Dict[str, Req] = {}
        self.poisoned: Set[int] = set()
        self.keep: List[Any] = []  # host staging of queued device copies, alive until they ran
        self.next_id = 0
        self.restart_due: Optional[str] = None
        self.content_checked = 0  # by decode instances that restarted since
        self.prefill_freed: List[int] = []  # freed, given out after the next step's hooks
        self.errors: Dict[str, int] = {}  # failed loads' errors (their tails), for --verbose
        self.stats = {"started": 0, "finished": 0, "failed": 0, "aborted": 0, "lost": 0, "restarts": 0,
                      "released_under_read": 0, "checked_bytes": 0}

    def close(self) -> None:
        self.drain()
        self.prefill.close()
        self.decode.close()

    # -- restarts: the processes go, and what they held with them

    def restart_prefill(self) -> None:
        self.log("restart prefill")
        self.drain()
        self.prefill.close()
        self.restarts += 1
        self.stats["restarts"] += 1
        self.prefill_gen += 1
        self.prefill_freed = []
        self.prefill = Instance(self, "prefill", self.cfg.prefill_tp, 16, PREFILL_BLOCKS)
        for r in self.reqs.values():
            if r.pstate != "done":
                r.pstate, r.pblocks = "done", []
                if r.dstate == "none":
                    r.dstate = "done"  # never handed off
                    r.outcome = r.outcome or "lost"

    def restart_decode(self) -> None:
        self.log("restart decode")
        self.content_checked += self.decode.content_checked()
        self.decode.close()
        self.restarts += 1
        self.stats["restarts"] += 1
        self.decode_gen += 1
        self.decode = Instance(self, "decode", self.cfg.decode_tp, self.cfg.decode_block, DECODE_BLOCKS)
        self.poisoned.clear()
        for r in self.reqs.values():
            if r.dstate not in ("none", "done"):
                r.dstate, r.dblocks = "done", []
                r.outcome = r.outcome or "lost"

    # -- content

    def request_of(self, r: Req, blocks: List[int]) -> kvbridge.Request:
        return kvbridge.Request(len(r.tokens), {"full": (blocks, [])})

    def compute_all(self, r: Req) -> None:
        """Host memory: the prefill's forward pass wrote every layer before its hooks run."""
        for rank in self.prefill.ranks:
            kvbridge.fill_request(rank.layout, self.request_of(r, r.pblocks), rank.host, side="local", seed=r.seed)

    def compute_layer(self, r: Req, layer: str) -> List[bytes]:
        """Device memory: each rank's copy of the layer is queued behind a slow kernel; the
        event recorded after it, per rank."""
        handles = []
        for k, rank in enumerate(self.prefill.ranks):
            staging = {name: t.clone() for name, t in rank.host.items()}
            kvbridge.fill_request(rank.layout, self.request_of(r, r.pblocks), staging, side="local", seed=r.seed)
            src = staging[layer]
            self.keep.append(staging)
            # Only the request's blocks (K and V of each): the others may have copies of their own
            # queued that a whole-tensor copy would overwrite with older bytes.
            block_bytes = src[0, 0].numel() * src.element_size()
            copies = []
            for kv in range(2):
                for b in r.pblocks:
                    off = (kv * PREFILL_BLOCKS + b) * block_bytes
                    copies.append((rank.ptrs[layer] + off, src.data_ptr() + off, block_bytes))
            handles.append(kvbridge.testing.device_copy_later(0, copies, self.cfg.producer_delay_s, stream=k))
        return handles

    def drain(self) -> None:
        """The step's device work ran (an engine's step ends when its forward pass did)."""
        if self.cfg.device:
            for k in range(len(self.prefill.ranks)):
                kvbridge.testing.device_drain(0, stream=k)
        self.keep.clear()

    def check_content(self, r: Req) -> None:
        for rank in self.decode.ranks:
            rep = kvbridge.check_request(rank.layout, self.request_of(r, r.dblocks), rank.host, side="local",
                                         seed=r.seed)
            if not rep.ok or rep.cells == 0:
                others = [f"{o.rid} p{o.pblocks} d{o.dblocks} {o.pstate}/{o.dstate}" for o in self.reqs.values()
                          if o is not r and (set(o.pblocks) & set(r.pblocks) or set(o.dblocks) & set(r.dblocks))]
                raise Violation(f"{r.rid}: reported finished with {rep.bad_cells} wrong cells of {rep.cells} on "
                                f"decode rank {rank.worker.rank}: {rep.first_error}; its history: " +
                                " | ".join(r.trace) + f"; sharing its blocks: {others}; free "
                                f"p{sorted(self.prefill.free)} d{sorted(self.decode.free)}")
            self.stats["checked_bytes"] += rep.bytes

    # -- blocks

    def blocks_of(self, t: torch.Tensor, count: int) -> torch.Tensor:
        return t.view(torch.uint8).view(2, count, -1)

    def check_poison(self, block: int) -> None:
        if block not in self.poisoned:
            return
        for rank in self.decode.ranks:
            for name, t in rank.host.items():
                raw = self.blocks_of(t, DECODE_BLOCKS)[:, block]
                if not bool((raw == POISON).all()):
                    raise Violation(f"decode block {block} ({name}) changed after its request ended: "
                                    f"{int((raw != POISON).sum())} bytes are not the poison (a late write)")

    def free_decode(self, r: Req) -> None:
        if r.decode_gen == self.decode_gen and r.dblocks:
            for rank in self.decode.ranks:
                for t in rank.host.values():
                    raw = self.blocks_of(t, DECODE_BLOCKS)
                    for b in r.dblocks:
                        raw[:, b] = POISON
            self.poisoned.update(r.dblocks)
            self.decode.free.extend(r.dblocks)
        r.dblocks = []

    def free_prefill(self, r: Req) -> None:
        """The engine frees the blocks. Its next step tells the workers (ConnectorMetadata.released)
        before its forward pass writes into them: free_prefill_now() runs there."""
        if r.prefill_gen == self.prefill_gen and r.pblocks:
            self.prefill_freed.extend(r.pblocks)
        r.pblocks = []

    def free_prefill_now(self) -> None:
        for r in self.reqs.values():
            if set(r.pblocks) & set(self.prefill_freed):
                r.note(f"BLOCKS {sorted(set(r.pblocks) & set(self.prefill_freed))} freed under it")
        """After the step's start_load_kv: the blocks go to others, whose bytes overwrite them (a
        reader still reading reads someone else's bytes)."""
        for rank in self.prefill.ranks:
            for t in rank.host.values():
                raw = self.blocks_of(t, PREFILL_BLOCKS)
                for b in self.prefill_freed:
                    raw[:, b] = self.rng.randrange(256)
        self.prefill.free.extend(self.prefill_freed)
        self.prefill_freed = []

    def reading(self, r: Req) -> bool:
        """Whether a decode rank still reads r's blocks: a layer of its load has not landed."""
        if r.dstate != "loading" or r.decode_gen != self.decode_gen:
            return False
        for rank in self.decode.ranks:
            for layer in kvbridge.layer_order(rank.layout):
                try:
                    rank.worker.worker.wait_for_layer(r.rid, layer, timeout=0)
                except kvbridge.Timeout as e:
                    # Not landed yet (the wait's own timeout), or a load that ended with a timeout.
                    if "did not land within" in str(e):
                        return True
                    break
                except kvbridge.Error:
                    break
        return False

    # -- requests

    def admit(self) -> None:
        n = self.rng.randint(8, 60)
        need = -(-n // 16)
        if len(self.prefill.free) < need:
            return
        rid = f"req-{self.cfg.seed}-{self.next_id}"
        self.next_id += 1
        pblocks = [self.prefill.free.pop(self.rng.randrange(len(self.prefill.free))) for _ in range(need)]
        r = Req(rid, self.rng.randrange(1 << 30), [self.rng.randrange(30000) for _ in range(n)], pblocks,
                stream=self.cfg.device, prefill_gen=self.prefill_gen)
        # About two restarts of each instance in 250 lifecycles, whatever the world's speed.
        restart = self.rng.random()
        self.restart_due = "prefill" if restart < 0.008 else "decode" if restart < 0.016 else None
        roll = self.rng.random()
        if roll < 0.06:
            r.prefill_abort = True
        elif roll < 0.30:
            r.abort_at = self.rng.choice(["before-meta", "loading", "loading", "after"])
            r.abort_steps = self.rng.randint(0, 3)
        params: Dict[str, Any] = {"do_remote_decode": True}
        if r.stream:
            params["stream_to"] = {"instance": "decode", "addresses": self.decode.handshakes()}
        s = self.prefill.scheduler
        assert s.get_num_new_matched_tokens(rid, r.tokens, 0, params) == (0, False)
        s.update_state_after_alloc(rid, r.pblocks, 0)
        self.reqs[rid] = r
        self.stats["started"] += 1
        if r.stream:
            r.params = s.transfer_params(rid)
            r.dstate = "blocks"  # admitted at the decode while the prefill computes
        else:
            r.pstate = "admitted"  # computed in the next step's forward pass

    def admit_decode(self, r: Req) -> None:
        d = self.decode
        need = -(-len(r.tokens) // d.block_size)
        if len(d.free) < need:
            return  # tried again next step
        r.dblocks = [d.free.pop(self.rng.randrange(len(d.free))) for _ in range(need)]
        for b in r.dblocks:
            self.check_poison(b)
            self.poisoned.discard(b)
        r.decode_gen = self.decode_gen
        got, is_async = d.scheduler.get_num_new_matched_tokens(r.rid, r.tokens, 0, r.params)
        assert (got, is_async) == (len(r.tokens), True), (got, is_async)
        d.scheduler.update_state_after_alloc(r.rid, r.dblocks, got)
        r.dstate = "loading"
        r.note(f"decode loading into {r.dblocks}")
        if r.abort_at == "before-meta":
            self.abort_decode(r)

    def abort_decode(self, r: Req) -> None:
        r.abort_at = "done"
        delay_free, _ = self.decode.scheduler.request_finished(r.rid, r.dblocks, aborted=True)
        r.outcome = r.outcome or "aborted"
        if delay_free:
            r.dstate = "aborting"  # the blocks are free at finished_sending
        else:
            self.free_decode(r)
            r.dstate = "done"

    # -- one step of each instance

    def step_prefill(self) -> None:
        p = self.prefill
        streaming = [r for r in self.reqs.values() if r.pstate == "computing"]
        meta = p.scheduler.build_connector_meta(finishing=[r.rid for r in streaming])
        layers = kvbridge.layer_order(p.ranks[0].layout)
        # The step's hooks first (they tell readers of the blocks the engine freed), then the
        # forward pass writes KV, into blocks that may be such freed ones given out again.
        for rank in p.ranks:
            rank.worker.bind_connector_metadata(meta)
            rank.worker.start_load_kv()
        self.free_prefill_now()
        for r in self.reqs.values():
            if r.pstate == "admitted":
                self.compute_all(r)
                r.pstate = "ready"
        events = {r.rid: self.compute_layer(r, layers[r.layers_done]) for r in streaming}
        for r in streaming:
            r.note(f"layer {r.layers_done} queued on blocks {r.pblocks}")
        for k, rank in enumerate(p.ranks):
            w = rank.worker
            for r in streaming:  # each request's layer with its own event
                w.bind_connector_metadata(dataclasses.replace(
                    meta, streams=[s for s in meta.streams if s.request_id == r.rid]))
                w.save_kv_layer(layers[r.layers_done], ready=events[r.rid][k])
            w.bind_connector_metadata(meta)
            w.wait_for_save()
            w.clear_connector_metadata()
        self.drain()
        for r in streaming:
            r.layers_done += 1
            if r.layers_done == LAYERS:
                r.pstate = "ready"
        p.scheduler.update_connector_output([rank.worker.build_connector_worker_meta() for rank in p.ranks])
        for r in self.reqs.values():
            if r.pstate != "ready":
                continue
            if r.prefill_abort:
                # Aborted by the prefill's engine. A streamed one may be being read: held until its
                # readers are done (finished_sending); one never handed off is freed at once.
                delay, _ = p.scheduler.request_finished(r.rid, r.pblocks, aborted=True)
                r.note(f"prefill aborted (delay_free {delay})")
                assert delay == r.stream, f"{r.rid}: delay_free {delay} for an abort of a streamed={r.stream} request"
                r.outcome = r.outcome or "aborted"
                if r.dstate == "none":
                    r.dstate = "done"
                if delay:
                    r.handed_at = time.monotonic()
                    r.pstate = "held"
                else:
                    self.free_prefill(r)
                    r.pstate = "done"
                continue
            delay, params = p.scheduler.request_finished(r.rid, r.pblocks)
            assert delay and params is not None
            r.note("handed off (held)")
            r.handed_at = time.monotonic()
            r.pstate = "held"
            if r.dstate == "none":
                r.params = params
                r.dstate = "blocks"
        f = p.scheduler.take_finished()
        reasons = {rel.request: rel.reason for rel in p.releases}
        p.releases.clear()
        for rid in f.finished_sending:
            r = self.reqs.get(rid)
            if r is None or r.pstate != "held":
                continue
            if self.reading(r):
                if reasons.get(rid) == "read":
                    raise Violation(f"{rid}: the prefill freed its blocks as read while a decode rank still read them "
                                    f"(decode {r.dstate}, abort {r.abort_at}, stream {r.stream})")
                r.released_under_read = True
                self.stats["released_under_read"] += 1
            r.note(f"prefill released ({reasons.get(rid)}), reading {r.released_under_read}")
            self.free_prefill(r)
            r.pstate = "done"

    def step_decode(self) -> None:
        d = self.decode
        for r in self.reqs.values():
            if r.dstate == "blocks":
                self.admit_decode(r)
        meta = d.scheduler.build_connector_meta()
        for rank in d.ranks:
            w = rank.worker
            w.bind_connector_metadata(meta)
            w.start_load_kv()
            for layer in kvbridge.layer_order(rank.layout):
                w.wait_for_layer_load(layer)
            w.wait_for_save()
            w.clear_connector_metadata()
        d.scheduler.update_connector_output([rank.worker.build_connector_worker_meta() for rank in d.ranks])
        f = d.scheduler.take_finished()
        for rid, o in f.outcomes.items():
            r = self.reqs.get(rid)
            if r is None or r.decode_gen != self.decode_gen or r.dstate not in ("loading", "aborting"):
                continue
            r.note(f"outcome {o.outcome}")
            if o.outcome == "finished":
                if r.released_under_read:
                    raise Violation(f"{rid}: finished although its prefill blocks were freed under its read")
                self.check_content(r)
            if o.outcome in ("failed", "recompute"):
                why = o.error.message
                key = why.split(": ", 2)[-1][:400]
                self.errors[key] = self.errors.get(key, 0) + 1
            if r.dstate == "aborting":
                continue  # its blocks are free at finished_sending
            r.outcome = r.outcome or o.outcome
            # The engine ends the request (at once when asked to abort right after the load).
            delay, _ = d.scheduler.request_finished(rid, r.dblocks, aborted=r.abort_at == "after")
            assert not delay, f"{rid}: the decode still holds blocks of a load that ended"
            self.free_decode(r)
            r.dstate = "done"
        for rid in f.finished_sending:
            r = self.reqs.get(rid)
            if r is not None and r.dstate == "aborting" and r.decode_gen == self.decode_gen:
                self.free_decode(r)
                r.dstate = "done"

    def perturb(self) -> None:
        for r in list(self.reqs.values()):
            if r.abort_at == "loading" and r.dstate == "loading" and r.decode_gen == self.decode_gen:
                if r.abort_steps > 0:
                    r.abort_steps -= 1
                else:
                    self.abort_decode(r)
        if self.restart_due == "prefill":
            self.restart_prefill()
        elif self.restart_due == "decode":
            self.restart_decode()
        self.restart_due = None

    def retire(self) -> None:
        for rid, r in list(self.reqs.items()):
            if r.pstate == "done" and r.dstate == "done":
                key = r.outcome if r.outcome in ("finished", "failed", "aborted", "recompute") else "lost"
                self.stats["failed" if key == "recompute" else key] += 1
                del self.reqs[rid]

    def check_holds(self) -> None:
        now = time.monotonic()
        # The reads end by the load's deadline; then their done comes, or the lease runs out; an
        # abort nobody was heard for waits its grace.
        bound = self.cfg.load_timeout_s + self.cfg.lease_s + 2.0 + GRACE_S
        for r in self.reqs.values():
            if r.pstate == "held" and now - r.handed_at > bound:
                raise Violation(f"{r.rid}: its prefill blocks are held {now - r.handed_at:.1f} s after the hand-off, "
                                f"past the load's deadline, the lease and a grace ({bound:.1f} s)")

    def run(self, lifecycles: int, deadline: float) -> Dict[str, int]:
        while time.monotonic() < deadline and (self.stats["started"] < lifecycles or self.reqs):
            if self.stats["started"] < lifecycles and len(self.reqs) < self.cfg.concurrency:
                self.admit()
            self.step_prefill()
            self.step_decode()
            self.perturb()
            self.retire()
            self.check_holds()
            time.sleep(0.0005)
        if self.reqs:
            raise Violation(f"{len(self.reqs)} requests did not end in time: " +
                            ", ".join(f"{r.rid} ({r.pstate}/{r.dstate})" for r in list(self.reqs.values())[:5]))
        # Quiet: every freed decode block is still the poison.
        for b in self.decode.free:
            self.check_poison(b)
        # With the content check on, the loads that finished were checked by it.
        checked = self.content_checked + self.decode.content_checked()
        if self.cfg.verify_content and self.stats["finished"] > 0 and checked == 0:
            raise Violation(f"{self.stats['finished']} loads finished and the content check hashed no byte")
        self.stats["content_checked"] = checked
        return self.stats


def run_world(seed: int, lifecycles: int, verbose: bool, device_ok: bool) -> Tuple[Optional[Dict[str, int]], List[str]]:
    """One world: its stats (None when an invariant broke or it failed) and the lines to print."""
    cfg = WorldConfig.draw(seed, device_ok)
    log = (lambda *m: print(f"  [{seed}]", *m, flush=True)) if verbose else None
    w = World(cfg, log)
    lines: List[str] = []
    try:
        stats = w.run(lifecycles, deadline=time.monotonic() + 600)
    except Exception as e:
        lines.append(f"lifecycle: world seed {seed} ({cfg}) failed: {type(e).__name__}: {e}")
        lines.append(f"lifecycle: replay with --seed {seed} --lifecycles {lifecycles} --worlds 1")
        return None, lines
    finally:
        w.close()
    if verbose:
        for why, n in sorted(w.errors.items(), key=lambda e: -e[1])[:6]:
            lines.append(f"  [{seed}] {n} x {why}")
    lines.append(f"lifecycle: world {seed}: {stats} ({cfg.prefill_tp}->{cfg.decode_tp}, "
                 f"{'device' if cfg.device else cfg.transport}, drop {cfg.drop}, dup {cfg.duplicate}, "
                 f"lease {cfg.lease_s}{', content checked' if cfg.verify_content else ''})")
    return stats, lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1, help="the first world's seed (worlds count up from it)")
    ap.add_argument("--lifecycles", type=int, default=300, help="requests per world")
    ap.add_argument("--worlds", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=0.0, help="run worlds until this many minutes passed")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --worlds: run this many worlds at once, each in a process of its own (a world "
                         "mostly waits on its engines, so several share a core)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    start = time.monotonic()
    total: Dict[str, int] = {}
    worlds = 0
    device_ok = device_fake()

    def add(stats: Dict[str, int]) -> None:
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v

    if a.jobs > 1 and a.minutes <= 0:
        import concurrent.futures
        import multiprocessing
        with concurrent.futures.ProcessPoolExecutor(max_workers=a.jobs,
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = [pool.submit(run_world, a.seed + i, a.lifecycles, a.verbose, device_ok) for i in range(a.worlds)]
            for run in runs:  # reported in seed order
                stats, lines = run.result()
                for line in lines:
                    print(line, flush=True)
                if stats is None:
                    pool.shutdown(wait=True, cancel_futures=True)
                    return 1
                add(stats)
                worlds += 1
    else:
        seed = a.seed
        while True:
            if a.minutes > 0:
                if time.monotonic() - start > a.minutes * 60:
                    break
            elif worlds >= a.worlds:
                break
            stats, lines = run_world(seed, a.lifecycles, a.verbose, device_ok)
            for line in lines:
                print(line, flush=True)
            if stats is None:
                return 1
            add(stats)
            seed += 1
            worlds += 1
    print(f"lifecycle: {worlds} worlds, {total.get('started', 0)} lifecycles in "
          f"{time.monotonic() - start:.0f} s: {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

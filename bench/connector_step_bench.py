#!/usr/bin/python3
"""What kvbridge.connector_v1 costs an engine's step, whatever the network does.

An engine calls the connector's hooks on its step's thread; none of them may wait on the
network. This drives a prefill instance and a decode instance (TP 1 each, in this process) step
after step and times each per-step call (p50 and p99, microseconds) when the other side is:

  healthy     the peer answers (the baseline, measured in the same run);
  silent      a port that accepts and never answers;
  dead        a port that refuses connections;
  restarting  the peer closes and comes back on new ports every few steps.

Prefill side: a request streamed to the decode instance each step (start_load_kv,
save_kv_layer per layer, wait_for_save, build_connector_worker_meta). Decode side: a request
loaded from the prefill instance each step (start_load_kv, wait_for_layer_load per layer,
build_connector_worker_meta, get_block_ids_with_load_errors).

Usage: PYTHONPATH=<build>/python /usr/bin/python3 bench/connector_step_bench.py [--steps N] [--json]
"""
import argparse
import json
import socket
import statistics
import sys
import time

import torch

import kvbridge
from kvbridge import connector_v1 as c1

LAYERS, HEADS, HEAD_SIZE, BLOCKS = 4, 4, 32, 64


class Side:
    def __init__(self, instance_id, role, block_size=16, stream=False):
        self.config = c1.ConnectorConfig(instance_id=instance_id, role=role, model="toy", num_kv_heads=HEADS,
                                         handshake_timeout_s=1.0, load_timeout_s=2.0, lease_s=5.0,
                                         heartbeat_s=0.5, stream=stream)
        self.caches = {f"layers.{i}": torch.zeros((2, BLOCKS, block_size, HEADS, HEAD_SIZE), dtype=torch.bfloat16)
                       for i in range(LAYERS)}
        self.worker = c1.WorkerConnector(self.config, 0)
        self.layout = self.worker.register_kv_caches(self.caches)
        self.scheduler = c1.SchedulerConnector(self.config, layout=self.layout)
        self.scheduler.set_xfer_handshake_metadata([self.worker.get_handshake_metadata()])
        self.layers = kvbridge.layer_order(self.layout)

    def close(self):
        self.worker.close()


def timed(samples, name, fn, *args, **kwargs):
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    samples.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)


def silent_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s, s.getsockname()[1]


def refused_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def unreachable_peer(kind):
    """(a socket to keep open, the peer's addresses) for a silent or dead peer; (None, None) for a
    live one."""
    if kind == "silent":
        keep, port = silent_port()
        return keep, [f"127.0.0.1:{port}"]
    if kind == "dead":
        return None, [f"127.0.0.1:{refused_port()}"]
    return None, None


def prefill_steps(kind, steps):
    """The prefill's hooks, each step streaming a new request to a decode instance of `kind`."""
    samples = {}
    p = Side("prefill", "prefill")
    d = Side("decode", "decode", stream=True) if kind in ("healthy", "restarting") else None
    keep, addresses = unreachable_peer(kind)
    try:
        for i in range(steps):
            if kind == "restarting" and i % 10 == 5:
                d.close()
                d = Side("decode", "decode", stream=True)
            if d is not None:
                addresses = [d.worker.get_handshake_metadata()]
            rid = f"s{i}"
            to = {"instance": "decode", "addresses": addresses}
            n, _ = p.scheduler.get_num_new_matched_tokens(rid, list(range(32)), 0, {"do_remote_decode": True,
                                                                                    "stream_to": to})
            p.scheduler.update_state_after_alloc(rid, [1 + i % (BLOCKS - 2), 1 + (i + 1) % (BLOCKS - 2)], n)
            if d is not None:  # the decode admits it too, as a router would
                d.scheduler.get_num_new_matched_tokens(rid, list(range(32)), 0, p.scheduler.transfer_params(rid))
                d.scheduler.update_state_after_alloc(rid, [1 + i % (BLOCKS - 2)], 32)
            meta = p.scheduler.build_connector_meta()
            w = p.worker
            w.bind_connector_metadata(meta)
            timed(samples, "start_load_kv", w.start_load_kv)
            for layer in p.layers:
                timed(samples, "save_kv_layer", w.save_kv_layer, layer)
            timed(samples, "wait_for_save", w.wait_for_save)
            out = []
            timed(samples, "build_connector_worker_meta", lambda: out.append(w.build_connector_worker_meta()))
            w.clear_connector_metadata()
            p.scheduler.update_connector_output(out)
            p.scheduler.request_finished(rid, [1])
            p.scheduler.take_finished()
            if d is not None:
                dm = d.scheduler.build_connector_meta()
                d.worker.bind_connector_metadata(dm)
                d.worker.start_load_kv()
                d.scheduler.update_connector_output([d.worker.build_connector_worker_meta()])
                d.scheduler.take_finished()
                d.worker.clear_connector_metadata()
            time.sleep(0.002)
    finally:
        p.close()
        if d is not None:
            d.close()
        if keep is not None:
            keep.close()
    return samples


def decode_steps(kind, steps):
    """The decode's hooks, each step loading a new request from a prefill instance of `kind`."""
    samples = {}
    d = Side("decode", "decode", block_size=32)
    p = Side("prefill", "prefill") if kind in ("healthy", "restarting") else None
    keep, addresses = unreachable_peer(kind)
    try:
        for i in range(steps):
            if kind == "restarting" and i % 10 == 5:
                p.close()
                p = Side("prefill", "prefill")
            rid = f"d{i}"
            if p is not None:
                p.scheduler.get_num_new_matched_tokens(rid, list(range(32)), 0, {"do_remote_decode": True})
                p.scheduler.update_state_after_alloc(rid, [1, 2], 0)
                p.worker.bind_connector_metadata(p.scheduler.build_connector_meta())
                p.worker.start_load_kv()
                p.scheduler.update_connector_output([p.worker.build_connector_worker_meta()])
                _, params = p.scheduler.request_finished(rid, [1, 2])
                p.scheduler.take_finished()
            else:
                params = {"do_remote_prefill": True, "remote_instance": "prefill", "remote_addresses": addresses,
                          "remote_block_ids": [1, 2], "remote_num_tokens": 32, "remote_request_id": rid}
            d.scheduler.get_num_new_matched_tokens(rid, list(range(32)), 0, params)
            d.scheduler.update_state_after_alloc(rid, [1 + i % (BLOCKS - 2)], 32)
            meta = d.scheduler.build_connector_meta(scheduled=[])
            w = d.worker
            w.bind_connector_metadata(meta)
            timed(samples, "start_load_kv", w.start_load_kv)
            for layer in d.layers:
                timed(samples, "wait_for_layer_load", w.wait_for_layer_load, layer)
            out = []
            timed(samples, "build_connector_worker_meta", lambda: out.append(w.build_connector_worker_meta()))
            timed(samples, "get_block_ids_with_load_errors", w.get_block_ids_with_load_errors)
            w.clear_connector_metadata()
            d.scheduler.update_connector_output(out)
            d.scheduler.take_finished()
            time.sleep(0.002)
    finally:
        d.close()
        if p is not None:
            p.close()
        if keep is not None:
            keep.close()
    return samples


def quantiles(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))], xs[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for side, run in (("prefill", prefill_steps), ("decode", decode_steps)):
        for kind in ("healthy", "silent", "dead", "restarting"):
            t0 = time.monotonic()
            samples = run(kind, a.steps)
            for call, xs in samples.items():
                p50, p99, worst = quantiles(xs)
                rows.append({"side": side, "peer": kind, "call": call, "calls": len(xs), "p50_us": round(p50, 1),
                             "p99_us": round(p99, 1), "max_us": round(worst, 1),
                             "steps_s": round(time.monotonic() - t0, 2)})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    base = {(r["side"], r["call"]): r for r in rows if r["peer"] == "healthy"}
    print(f"{'side':8} {'peer':11} {'call':31} {'p50 us':>9} {'p99 us':>9} {'max us':>9} {'p99/healthy':>12}")
    for r in rows:
        b = base.get((r["side"], r["call"]))
        ratio = f"{r['p99_us'] / b['p99_us']:.2f}" if b and b["p99_us"] > 0 else "-"
        print(f"{r['side']:8} {r['peer']:11} {r['call']:31} {r['p50_us']:9.1f} {r['p99_us']:9.1f} "
              f"{r['max_us']:9.1f} {ratio:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

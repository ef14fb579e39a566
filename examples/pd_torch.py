#!/usr/bin/python3
"""The smallest complete prefill/decode (P/D) transfer of torch KV caches with kvbridge.

Two processes, each with an Engine and a ConnectorWorker over vLLM-shaped caches
(one tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_size], bf16):

  prefill: fills its cache (here: seeded random values, standing in for the model's KV),
           holds request req-1's blocks in a PrefillScheduler until the reader says done.
  decode:  pulls request req-1's KV into its own (different) block ids with start_load(),
           which queues it (the worker's threads do the handshake, the plan and the reads);
           then checks byte for byte that every token it
           pulled equals the prefill values, and that nothing else in its cache was written.

The parent process only starts the two and passes the prefill side channel's address
(in an engine: the router's job). Run: PYTHONPATH=<build>/python /usr/bin/python3 examples/pd_torch.py
"""

import multiprocessing as mp
import sys
import time

import torch

import kvbridge

LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 4, 16, 16, 8, 64
NUM_TOKENS = 40                       # 2.5 blocks
PREFILL_BLOCKS = [4, 5, 6]            # where prefill computed request 1
DECODE_BLOCKS = [9, 10, 11]           # where decode wants it
REQUEST = "req-1"  # engines name requests with strings (an int is taken as its decimal text)


def make_caches(fill_seed=None):
    """The engine's KV caches and their kvbridge Layout."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    if fill_seed is None:
        kv = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    else:
        g = torch.Generator().manual_seed(fill_seed)
        kv = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    layout = kvbridge.layout_from_tensors({
        "model": "toy-llama",
        "tensors": {f"kv.{i}": t for i, t in enumerate(kv)},
        "dims": "block position head cell",   # what each dim of kv[i][0] means
        "groups": {"full": {"layers": {f"layers.{i}": {"k": t[0], "v": t[1]} for i, t in enumerate(kv)}}},
    })
    return kv, layout


def prefill(conn, say):
    kv, layout = make_caches(fill_seed=1234)
    with kvbridge.Engine(name="prefill/r0") as engine, \
            kvbridge.ConnectorWorker(engine, layout, kv, instance_id="prefill") as worker:
        scheduler = kvbridge.PrefillScheduler(lease=10.0)
        scheduler.hold(REQUEST, {"decode/r0"})
        conn.send(worker.side_channel_address)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for event in worker.take_reader_events():
                scheduler.on_reader_event(event)
            for release in scheduler.take_releases():
                say(f"prefill: request {release.request} released ({release.reason}), blocks "
                      f"{PREFILL_BLOCKS} may be reused")
                return 0
            time.sleep(0.005)
        say("prefill: no release within 30 s")
        return 1


def decode(prefill_address, say):
    kv, layout = make_caches()
    with kvbridge.Engine(name="decode/r0") as engine, \
            kvbridge.ConnectorWorker(engine, layout, kv, instance_id="decode") as worker:
        worker.add_remote("prefill", [prefill_address])
        scheduler = kvbridge.DecodeScheduler(ranks=1, policy="fail")
        scheduler.expect(REQUEST, timeout=30.0)
        worker.start_load(REQUEST, "prefill",
                          kvbridge.Request(NUM_TOKENS, {"full": (DECODE_BLOCKS, PREFILL_BLOCKS)}))
        result = worker.collect(REQUEST, timeout=30.0)[REQUEST]
        scheduler.rank_result(0, result)
        (outcome,) = scheduler.take_outcomes()
        say(f"decode: request {outcome.request} {outcome.outcome}: {result.bytes} bytes in "
              f"{result.descriptors} descriptors (naive: {result.naive_descriptors})")
        if outcome.outcome != "finished":
            say(f"decode: {outcome.error}")
            return 1

        # Byte-exact check: token t of the request sits in block DECODE_BLOCKS[t // 16] here
        # and PREFILL_BLOCKS[t // 16] there.
        expected, _ = make_caches(fill_seed=1234)
        bad = 0
        for got, want in zip(kv, expected):
            tokens_got = got[:, DECODE_BLOCKS].flatten(1, 2)[:, :NUM_TOKENS]
            tokens_want = want[:, PREFILL_BLOCKS].flatten(1, 2)[:, :NUM_TOKENS]
            bad += int((tokens_got.view(torch.int16) != tokens_want.view(torch.int16)).sum())
            for i, block in enumerate(DECODE_BLOCKS):  # what remains must be untouched zeros
                got[:, block, :NUM_TOKENS - i * BLOCK_SIZE] = 0
            bad += int(got.view(torch.int16).count_nonzero())
        say(f"decode: {LAYERS} layers x {NUM_TOKENS} tokens compared byte-exact: "
              f"{'OK' if bad == 0 else f'{bad} values differ'}")
        return 0 if bad == 0 else 1


def main():
    # The children report through a pipe so the output reads in order.
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    reports = ctx.Queue()
    p = ctx.Process(target=run_prefill, args=(child_end, reports), name="prefill")
    p.start()
    if not parent_end.poll(30):
        print("prefill did not start")
        p.kill()
        return 1
    address = parent_end.recv()
    print(f"parent: prefill side channel at {address}")
    d = ctx.Process(target=run_decode, args=(address, reports), name="decode")
    d.start()
    for proc in (d, p):
        proc.join(60)
    ok = True
    for proc in (d, p):
        if proc.is_alive():
            proc.kill()
            print(f"{proc.name} did not finish")
            ok = False
    lines = {}
    while len(lines) < 2 and ok:
        role, said = reports.get(timeout=10)
        lines[role] = said
    for role in ("decode", "prefill"):
        for line in lines.get(role, []):
            print(line)
    ok = ok and p.exitcode == 0 and d.exitcode == 0
    print("parent: P/D transfer " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


def run_prefill(conn, reports):
    said = []
    code = prefill(conn, said.append)
    reports.put(("prefill", said))
    sys.exit(code)


def run_decode(address, reports):
    said = []
    code = decode(address, said.append)
    reports.put(("decode", said))
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Prefill/decode disaggregation through kvbridge.connector_v1, the way an engine wires it.

Two processes with vLLM-shaped bf16 caches (per layer [2 (K, V), num_blocks, block_size,
kv_heads, head_size]):

  prefill: TP 1, 16-token blocks. Its scheduler half admits request req-1 (handed over to
           decode: kv_transfer_params {"do_remote_decode": True}), its
           rank "computes" the prompt's KV (seeded values standing in for the model), and
           request_finished() returns the kv_transfer_params for the decode instance while
           the blocks stay held until both decode ranks said done.
  decode:  TP 2 (two ranks, one thread each, as an engine's two GPU workers), 32-token
           blocks. Its scheduler half takes the params (the router's job, here the parent's),
           allocates blocks, and each step hands the metadata to both ranks, whose
           start_load_kv() reads each rank's heads from prefill. Then every token is checked
           byte for byte against what prefill computed.

Run: PYTHONPATH=<build>/python /usr/bin/python3 examples/connector_v1_pd.py
"""

import multiprocessing as mp
import sys
import threading
import time

import torch

import kvbridge
from kvbridge import connector_v1

LAYERS, KV_HEADS, HEAD_SIZE = 4, 8, 64
PROMPT = list(range(1000, 1040))  # 40 tokens
PREFILL_BLOCKS = [4, 5, 6]        # 16-token blocks
DECODE_BLOCKS = [7, 2]            # 32-token blocks


def caches(tp, block_size, num_blocks=16, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, num_blocks, block_size, KV_HEADS // tp, HEAD_SIZE)
    return {f"layers.{i}": (torch.randn(shape, generator=g).to(torch.bfloat16) if g else
                            torch.zeros(shape, dtype=torch.bfloat16)) for i in range(LAYERS)}


def prefill_main(conn):
    config = connector_v1.ConnectorConfig(instance_id="prefill", role="prefill", tp_size=1, model="toy-llama",
                                          num_kv_heads=KV_HEADS)
    kv = caches(1, 16, seed=1234)  # the prompt's KV, as the forward pass left it
    with connector_v1.WorkerConnector(config, rank=0) as worker:
        layout = worker.register_kv_caches(kv)
        scheduler = connector_v1.SchedulerConnector(config, layout=layout)
        scheduler.set_xfer_handshake_metadata([worker.get_handshake_metadata()])
        scheduler.get_num_new_matched_tokens("req-1", PROMPT, 0, conn.recv())  # {"do_remote_decode": ...}
        scheduler.update_state_after_alloc("req-1", PREFILL_BLOCKS, 0)
        step(scheduler, [worker])  # the prefill's forward pass
        delay_free, params = scheduler.request_finished("req-1", PREFILL_BLOCKS)
        conn.send(params)  # to the router
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "req-1" in step(scheduler, [worker]).finished_sending:
                print(f"prefill: req-1 blocks freed (held: {delay_free}, until both decode ranks were done)")
                return 0
            time.sleep(0.005)
    print("prefill: req-1 never released")
    return 1


def decode_main(conn):
    config = connector_v1.ConnectorConfig(instance_id="decode", role="decode", tp_size=2, model="toy-llama",
                                          num_kv_heads=KV_HEADS)
    kv = [caches(2, 32) for _ in range(2)]
    workers = [connector_v1.WorkerConnector(config, rank=r) for r in range(2)]
    try:
        layouts = [w.register_kv_caches(k) for w, k in zip(workers, kv)]
        scheduler = connector_v1.SchedulerConnector(config, layout=layouts[0])
        scheduler.set_xfer_handshake_metadata([w.get_handshake_metadata() for w in workers])
        params = conn.recv()  # prefill's kv_transfer_params, through the router
        external, is_async = scheduler.get_num_new_matched_tokens("req-1", PROMPT, 0, params)
        print(f"decode: req-1 has {external} external tokens (async: {is_async})")
        scheduler.update_state_after_alloc("req-1", DECODE_BLOCKS, external)
        t0 = time.monotonic()
        deadline = t0 + 60
        while time.monotonic() < deadline:
            done = step(scheduler, workers)
            if "req-1" in done.finished_recving:
                outcome = done.outcomes["req-1"]
                break
            time.sleep(0.002)
        else:
            print("decode: req-1 did not load")
            return 1
        if outcome.outcome != "finished":
            print(f"decode: req-1 {outcome.outcome}: {outcome.error}")
            return 1
        print(f"decode: req-1 finished on 2 ranks in {1000 * (time.monotonic() - t0):.1f} ms")
        # Byte for byte: token t sits in block PREFILL_BLOCKS[t // 16] at slot t % 16 there, and
        # in DECODE_BLOCKS[t // 32] at slot t % 32 here, with heads split over the two ranks.
        want = caches(1, 16, seed=1234)
        bad = 0
        for name, w in want.items():
            tokens_want = w[:, PREFILL_BLOCKS].flatten(1, 2)[:, :len(PROMPT)]
            for r in range(2):
                got = kv[r][name][:, DECODE_BLOCKS].flatten(1, 2)[:, :len(PROMPT)]
                heads = tokens_want[:, :, r * KV_HEADS // 2:(r + 1) * KV_HEADS // 2]
                bad += int((got.view(torch.int16) != heads.view(torch.int16)).sum())
                rest = kv[r][name].clone()  # and nothing else of the cache was written
                for i, block in enumerate(DECODE_BLOCKS):
                    rest[:, block, :len(PROMPT) - i * 32] = 0
                bad += int(rest.view(torch.int16).count_nonzero())
        print(f"decode: {LAYERS} layers x {len(PROMPT)} tokens x {KV_HEADS} heads compared byte-exact: "
              f"{'OK' if bad == 0 else f'{bad} values differ'}")
        return 0 if bad == 0 else 1
    finally:
        for w in workers:
            w.close()


def step(scheduler, workers):
    """One engine step: metadata to every rank (each on its own thread), outputs back."""
    meta = scheduler.build_connector_meta()

    def run(w):
        w.bind_connector_metadata(meta)
        w.start_load_kv()
        for layer in kvbridge.layer_order(w.layout):
            w.wait_for_layer_load(layer)
            w.save_kv_layer(layer)
        w.wait_for_save()
        w.clear_connector_metadata()

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    scheduler.update_connector_output([w.build_connector_worker_meta() for w in workers])
    return scheduler.take_finished()


def child(main, conn):
    sys.exit(main(conn))


def main():
    ctx = mp.get_context("spawn")
    p_end, p_child = ctx.Pipe()
    d_end, d_child = ctx.Pipe()
    procs = [ctx.Process(target=child, args=(prefill_main, p_child), name="prefill"),
             ctx.Process(target=child, args=(decode_main, d_child), name="decode")]
    for proc in procs:
        proc.start()
    ok = True
    try:
        # The router: a request for prefill that decode instance "decode" (2 ranks) will read ...
        p_end.send({"do_remote_decode": True})
        if not p_end.poll(60):
            raise TimeoutError("prefill sent no kv_transfer_params")
        params = p_end.recv()
        print(f"router: prefill returned kv_transfer_params for {params['remote_num_tokens']} tokens in blocks "
              f"{params['remote_block_ids']} of instance {params['remote_instance']!r}")
        d_end.send(params)  # ... and forwards its answer to decode
    except (TimeoutError, EOFError) as e:
        print(f"router: {e}")
        ok = False
    for proc in procs:
        proc.join(90)
        if proc.is_alive():
            proc.kill()
            print(f"{proc.name} did not finish")
            ok = False
    ok = ok and all(proc.exitcode == 0 for proc in procs)
    print("parent: P/D through connector_v1 " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

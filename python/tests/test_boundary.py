"""The boundary contracts of kvbridge.connector_v1, each as an engine developer found it broken:
a streamed layer read before its producer wrote it, an abort lost before hand-off, a hold
count that was configured (and wrong), a restarted prefill that could never be read again,
a prefill step that blocked and threw on the network, a decode step stalled by loads it does
not compute, load errors that blamed blocks that did not fail, and a Redis tier whose typo
went unnoticed. Each test drives the halves as an engine does (test_connector_v1.Instance)."""
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import kvbridge
from kvbridge import connector_v1 as c1
from test_connector_v1 import Instance, prefill_request

# ---------------------------------------------------------------------------- readiness

READY_BODY = '''
    import ctypes, time, types
    import numpy as np
    import torch
    import kvbridge
    from kvbridge import connector_v1 as c1, testing

    assert testing.device_name() == "fake"
    LAYERS, HEADS, HS, BLOCKS, BS = 2, 4, 32, 8, 16

    def caches():
        out, raw = {}, {}
        for i in range(LAYERS):
            kv, ptr = cuda_empty((2, BLOCKS, BS, HEADS, HS))
            out[f"layers.{i}"] = kv
            raw[f"layers.{i}"] = (ptr, kv.host.view(torch.uint8).view(-1))
        return out, raw

    def instance(name, role, mode_extra=None):
        cfg = c1.ConnectorConfig(instance_id=name, role=role, model="toy", num_kv_heads=HEADS, stream=True)
        w = c1.WorkerConnector(cfg, 0)
        kv, raw = caches()
        layout = w.register_kv_caches(kv)
        s = c1.SchedulerConnector(cfg, layout=layout)
        s.set_xfer_handshake_metadata([w.get_handshake_metadata()])
        return cfg, w, s, raw

    _, pw, ps, praw = instance("prefill", "prefill")
    _, dw, ds, draw = instance("decode", "decode")
    prompt = list(range(32))
    stream_to = {"instance": "decode", "addresses": [dw.get_handshake_metadata()]}
    n, _ = ps.get_num_new_matched_tokens("r", prompt, 0, {"do_remote_decode": True, "stream_to": stream_to})
    ps.update_state_after_alloc("r", [2, 3], n)
    early = ps.transfer_params("r")
    ds.get_num_new_matched_tokens("r", prompt, 0, early)
    ds.update_state_after_alloc("r", [5, 6], 32)
    dmeta = ds.build_connector_meta()
    dw.bind_connector_metadata(dmeta)
    dw.start_load_kv()
    pmeta = ps.build_connector_meta()
    pw.bind_connector_metadata(pmeta)
    pw.start_load_kv()
    # The forward pass queues each layer's kernels, and the hook runs at once:
    # the bytes land DELAY later, when the event recorded after them completes.
    for i, layer in enumerate(kvbridge.layer_order(pw.layout)):
        ptr, t = praw[layer]
        handle = testing.device_fill_later(0, ptr, t.numel(), 0x40 + i, DELAY)
        pw.save_kv_layer(layer, ready=handle)
    pw.wait_for_save()
    deadline = time.monotonic() + 20
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        ds.update_connector_output([dw.build_connector_worker_meta()])
        ps.update_connector_output([pw.build_connector_worker_meta()])
        f = ds.take_finished()
        outcome = f.outcomes.get("r")
        time.sleep(0.01)
    assert outcome is not None, "the load did not end"
    wrong = 0
    for i, layer in enumerate(kvbridge.layer_order(dw.layout)):
        _, t = draw[layer]
        kv = t.view(2, BLOCKS, BS * HEADS * HS * 2)
        for b in (5, 6):
            wrong += int((kv[:, b] != 0x40 + i).sum())
    print("outcome", outcome.outcome, "wrong", wrong)
    assert outcome.outcome == "finished", outcome.error
    assert wrong == 0, f"{wrong} bytes read before their producer wrote them"
    pw.close(); dw.close()
'''


def test_a_streamed_layer_is_read_only_after_its_producers_event_completed():
    """The prefill's save_kv_layer hook runs as soon as the layer's kernels are queued; on the
    fake device they land 50 ms later. The decode's copy waits for the event recorded after
    them, so every byte it reports loaded is the producer's, not the zeros before."""
    env = dict(os.environ, KVB_DEVICE="fake")
    here = os.path.dirname(os.path.abspath(__file__))
    prelude = f"import sys\nsys.path.insert(0, {here!r})\nfrom fake_cuda import cuda_empty\n"
    body = prelude + "DELAY = 0.05\n" + textwrap.dedent(READY_BODY)
    r = subprocess.run([sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "outcome finished wrong 0" in r.stdout, r.stdout


# ---------------------------------------------------------------------------- finality


@pytest.fixture
def pd():
    made = []

    def make(prefill_tp=1, decode_tp=2, prefill_kw=None, decode_kw=None):
        p = Instance("prefill", "prefill", prefill_tp, 16, **(prefill_kw or {}))
        d = Instance("decode", "decode", decode_tp, 32, **(decode_kw or {}))
        made.extend([p, d])
        return p, d

    yield make
    for inst in made:
        inst.close()


def test_an_abort_before_the_load_reaches_the_workers_moves_nothing(pd):
    """request_finished (the engine aborts) between update_state_after_alloc and the next
    build_connector_meta: the load becomes one of no token, so no byte lands in blocks the
    engine may already have given to another request, and the prefill still frees its own."""
    p, d = pd()
    prompt = list(range(100, 140))
    params = prefill_request(p, "req-a", prompt, [3, 4, 5], seed=11)
    assert d.scheduler.get_num_new_matched_tokens("req-a", prompt, 0, params) == (40, True)
    d.scheduler.update_state_after_alloc("req-a", [6, 2], 40)
    delay_free, _ = d.scheduler.request_finished("req-a", [6, 2], aborted=True)
    assert delay_free  # the ranks confirm first
    seen = d.run_until(lambda f: "req-a" in f.finished_sending)
    assert "req-a" not in seen.outcomes or seen.outcomes["req-a"].outcome != "finished"
    for kv in d.caches:
        for t in kv.values():
            assert int(t.count_nonzero()) == 0, "bytes of an aborted request landed"
    p.run_until(lambda f: "req-a" in f.finished_sending)  # told done: freed without its lease


def test_the_prefill_holds_its_blocks_until_every_decode_rank_that_reads_them_is_done(pd):
    """Prefill TP 4 read by decode TP 2: nobody configures how many readers there are. The
    blocks are released only once both decode ranks ended their loads; each decode rank's
    done says how many ranks its instance has."""
    p, d = pd(prefill_tp=4, decode_tp=2, decode_kw={"engine_faults": "delay=30"})
    prompt = list(range(200, 240))
    params = prefill_request(p, "req-h", prompt, [1, 2, 3], seed=5)
    d.scheduler.get_num_new_matched_tokens("req-h", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-h", [4, 5], 40)
    released_while_loading = False
    deadline = time.monotonic() + 30
    done = False
    outcomes = {}
    while not done and time.monotonic() < deadline:
        outcomes.update(d.step().outcomes)
        f = p.step()
        if "req-h" in f.finished_sending:
            # A decode rank still reads while a transfer of its load is in flight (or none began).
            # Its load itself ends later: ok only once the prefill answered its done "held".
            def reading(w):
                m = w.engine.metrics()
                return m.transfers_submitted == 0 or \
                    m.transfers_done + m.transfers_failed + m.transfers_cancelled < m.transfers_submitted
            released_while_loading = any(reading(w) for w in d.workers)
            done = True
        time.sleep(0.005)
    assert done, "the prefill never released the request"
    assert not released_while_loading, "the prefill freed its blocks while a decode rank still read them"
    if "req-h" not in outcomes:
        outcomes.update(d.run_until(lambda f: "req-h" in f.finished_recving).outcomes)
    assert outcomes["req-h"].outcome == "finished", outcomes["req-h"].error
    d.check([4, 5], 40, seed=5)


def test_a_streamed_request_the_prefill_aborts_keeps_its_blocks_until_its_reader_is_done(pd):
    """A prefill engine aborts a request it streams (its client went away) while the decode reads
    the layers announced so far. Freeing the blocks then would let the reader read their next
    owner's bytes: they are held until the reader is done (or its lease runs out)."""
    p, d = pd(decode_kw={"stream": True, "load_timeout_s": 1.0}, decode_tp=1)
    stream_to = {"instance": "decode", "addresses": [w.get_handshake_metadata() for w in d.workers]}
    prompt = list(range(32))
    n, _ = p.scheduler.get_num_new_matched_tokens("req-x", prompt, 0, {"do_remote_decode": True,
                                                                       "stream_to": stream_to})
    p.scheduler.update_state_after_alloc("req-x", [5, 6], n)
    early = p.scheduler.transfer_params("req-x")
    d.scheduler.get_num_new_matched_tokens("req-x", prompt, 0, early)
    d.scheduler.update_state_after_alloc("req-x", [1], 32)
    d.step()  # the decode starts reading as layers are announced
    p.fill([5, 6], 32, seed=4)
    meta = p.scheduler.build_connector_meta()
    for w in p.workers:  # one layer announced, then the engine aborts the request
        w.bind_connector_metadata(meta)
        w.start_load_kv()
        w.save_kv_layer(kvbridge.layer_order(w.layout)[0])
    delay_free, params = p.scheduler.request_finished("req-x", [5, 6], aborted=True)
    assert delay_free and params is None
    outcome = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        f = d.step()
        outcome = f.outcomes.get("req-x", outcome)
        sent = p.step().finished_sending
        if "req-x" in sent:
            assert outcome is not None, "the prefill freed blocks its reader was still reading"
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the aborted request's blocks were never freed")
    assert outcome.outcome == "failed"  # the rest was never announced: not finished


# ---------------------------------------------------------------------------- membership


def test_a_restarted_prefill_is_read_again_and_a_hand_off_from_its_old_process_fails_naming_both(pd):
    p, d = pd()
    prompt = list(range(300, 340))
    params = prefill_request(p, "req-1", prompt, [3, 4, 5], seed=1)
    stale = prefill_request(p, "req-old", prompt, [6, 7, 8], seed=2)  # handed off, never read
    d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-1", [1, 2], 40)
    assert d.run_until(lambda f: "req-1" in f.outcomes).outcomes["req-1"].outcome == "finished"
    old = p.workers[0].get_handshake_metadata().incarnation
    # The prefill instance restarts: new processes, new ports, the same name.
    p.close()
    p2 = Instance("prefill", "prefill", 1, 16)
    try:
        new = p2.workers[0].get_handshake_metadata().incarnation
        assert new != old
        params = prefill_request(p2, "req-2", prompt, [3, 4, 5], seed=3)
        d.scheduler.get_num_new_matched_tokens("req-2", prompt, 0, params)
        d.scheduler.update_state_after_alloc("req-2", [3, 4], 40)
        seen = d.run_until(lambda f: "req-2" in f.outcomes)
        assert seen.outcomes["req-2"].outcome == "finished", seen.outcomes["req-2"].error
        d.check([3, 4], 40, seed=3)
        # A request the old process handed off: its KV went with it.
        d.scheduler.get_num_new_matched_tokens("req-old", prompt, 0, stale)
        d.scheduler.update_state_after_alloc("req-old", [5, 6], 40)
        seen = d.run_until(lambda f: "req-old" in f.outcomes)
        o = seen.outcomes["req-old"]
        assert o.outcome == "failed"
        assert old in o.error.message and new in o.error.message and "restarted" in o.error.message, o.error
    finally:
        p2.close()


# ---------------------------------------------------------------------------- the step


def silent_listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)  # accepts in the kernel, never answers
    return s


def refused_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("peer", ["silent", "refused"])
def test_the_prefill_step_never_blocks_or_raises_whatever_the_decode_does(pd, peer):
    p, _ = pd(prefill_kw={"handshake_timeout_s": 2.0})
    keep = silent_listener()
    try:
        port = keep.getsockname()[1] if peer == "silent" else refused_port()
        to = {"instance": "decode-x", "addresses": [f"127.0.0.1:{port}"]}
        prompt = list(range(16))
        n, _ = p.scheduler.get_num_new_matched_tokens("req-s", prompt, 0, {"do_remote_decode": True,
                                                                           "stream_to": to})
        p.scheduler.update_state_after_alloc("req-s", [1], n)
        slowest = 0.0
        errors = {}
        for _ in range(3):
            t0 = time.monotonic()
            p.step()
            slowest = max(slowest, time.monotonic() - t0)
            for out in p.outputs:
                errors.update(out.stream_errors)
            time.sleep(0.05)
        assert slowest < 0.5, f"a prefill step took {slowest:.2f} s with a {peer} decode"
        deadline = time.monotonic() + 10
        while "req-s" not in errors and time.monotonic() < deadline:
            p.step()
            for out in p.outputs:
                errors.update(out.stream_errors)
            time.sleep(0.05)
        assert "req-s" in errors and "decode-x" in errors["req-s"], errors
    finally:
        keep.close()


def test_wait_for_layer_load_waits_only_for_the_requests_the_batch_computes(pd):
    p, d = pd(decode_kw={"stream": True, "load_timeout_s": 1.0})
    stream_to = {"instance": "decode", "addresses": [w.get_handshake_metadata() for w in d.workers]}
    prompt = list(range(32))
    n, _ = p.scheduler.get_num_new_matched_tokens("req-w", prompt, 0, {"do_remote_decode": True,
                                                                       "stream_to": stream_to})
    p.scheduler.update_state_after_alloc("req-w", [5, 6], n)
    early = p.scheduler.transfer_params("req-w")
    d.scheduler.get_num_new_matched_tokens("req-w", prompt, 0, early)
    d.scheduler.update_state_after_alloc("req-w", [1, 2], 32)
    # The prefill has not computed anything: a wait for the load would last its deadline.
    meta = d.scheduler.build_connector_meta()
    assert meta.computes == []
    t0 = time.monotonic()
    for w in d.workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv()
        for layer in kvbridge.layer_order(w.layout):
            w.wait_for_layer_load(layer)
    assert time.monotonic() - t0 < 0.3, "a load the batch does not compute held the step up"
    # A batch that computes it waits for its layers (here until the load's deadline).
    meta = d.scheduler.build_connector_meta(scheduled=["req-w", "other"])
    assert meta.computes == ["req-w"]
    t0 = time.monotonic()
    d.workers[0].bind_connector_metadata(meta)
    d.workers[0].wait_for_layer_load(kvbridge.layer_order(d.workers[0].layout)[0])
    assert time.monotonic() - t0 > 0.5


# ---------------------------------------------------------------------------- failure reports


def test_load_errors_name_only_blocks_whose_load_failed(pd):
    p, d = pd()
    prompt = list(range(400, 440))
    # A block list naming a block the decode does not have: the load fails, and only the
    # real block is named for recompute.
    params = prefill_request(p, "req-e", prompt, [3, 4, 5], seed=1)
    d.scheduler.get_num_new_matched_tokens("req-e", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-e", [3, 999], 40)
    seen = d.run_until(lambda f: "req-e" in f.outcomes)
    assert seen.outcomes["req-e"].outcome == "failed"
    bad = set()
    for w in d.workers:
        bad |= w.get_block_ids_with_load_errors()
    assert bad == {3}, bad
    # An aborted load's blocks are the engine's to free, not to recompute.
    params = prefill_request(p, "req-b", prompt, [6, 7, 8], seed=2)
    d.scheduler.get_num_new_matched_tokens("req-b", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-b", [5, 6], 40)
    meta = d.scheduler.build_connector_meta()
    for w in d.workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv()
    d.scheduler.request_finished("req-b", [5, 6], aborted=True)
    d.run_until(lambda f: "req-b" in f.finished_sending)
    bad = set()
    for w in d.workers:
        bad |= w.get_block_ids_with_load_errors()
    assert bad == set(), bad


def test_a_redis_tier_that_cannot_be_reached_says_why_from_the_start():
    port = refused_port()
    store = kvbridge.Store(hash_block_tokens=16, redis=f"127.0.0.1:{port}")
    stats = store.stats()
    assert stats["redis_up"] is False
    assert f"127.0.0.1:{port}" in stats["redis_last_error"] and "connect" in stats["redis_last_error"], stats

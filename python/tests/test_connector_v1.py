"""kvbridge.connector_v1 driven the way an engine drives its KV connector: the scheduler half
and the worker halves of a prefill and a decode instance, in one process (the two-process
version is examples/connector_v1_pd.py, run by test_examples_connector_v1)."""
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch

import kvbridge
from kvbridge import connector_v1 as c1
from conftest import EXAMPLES

LAYERS, HEADS, HEAD_SIZE = 2, 4, 32


def caches(blocks, block_size, heads, dtype=torch.bfloat16):
    return {f"layers.{i}": torch.zeros((2, blocks, block_size, heads, HEAD_SIZE), dtype=dtype) for i in range(LAYERS)}


class Instance:
    """One instance: its scheduler half and one worker half per rank (an engine's pieces)."""

    def __init__(self, instance_id, role, tp, block_size, blocks=16, device=False, **extra):
        """device: the caches are the host fake's device memory (KVB_DEVICE=fake), registered as
        cuda:0; self.caches are host views of the same bytes, which fill() and check() use."""
        self.config = c1.ConnectorConfig(instance_id=instance_id, role=role, tp_size=tp, model="toy",
                                         num_kv_heads=HEADS, **extra)
        self.ptrs = []
        if device:
            from fake_cuda import device_caches
            made = [device_caches([f"layers.{i}" for i in range(LAYERS)],
                                  (2, blocks, block_size, HEADS // tp, HEAD_SIZE)) for _ in range(tp)]
            registered = [m[0] for m in made]
            self.caches = [m[1] for m in made]
            self.ptrs = [ptr for m in made for ptr in m[2].values()]
        else:
            self.caches = [caches(blocks, block_size, HEADS // tp) for _ in range(tp)]
            registered = self.caches
        self.workers = [c1.WorkerConnector(self.config, r) for r in range(tp)]
        self.layouts = [w.register_kv_caches(kv) for w, kv in zip(self.workers, registered)]
        self.scheduler = c1.SchedulerConnector(self.config, layout=self.layouts[0])
        self.scheduler.set_xfer_handshake_metadata({r: w.get_handshake_metadata() for r, w in enumerate(self.workers)})
        self.block_size = block_size

    def step(self, finishing=None):
        """One engine step: the metadata to every rank, the forward pass's hooks, the outputs back."""
        meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(finishing)))
        for w in self.workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv()
            for layer in kvbridge.layer_order(w.layout):
                w.wait_for_layer_load(layer)
                w.save_kv_layer(layer)
            w.wait_for_save()
            w.clear_connector_metadata()
        outputs = [pickle.loads(pickle.dumps(w.build_connector_worker_meta())) for w in self.workers]
        self.outputs = outputs
        self.scheduler.update_connector_output(outputs)
        return self.scheduler.take_finished()

    def run_until(self, pred, timeout=20.0, also=()):
        """Steps until pred(what finished so far) holds; each instance of `also` steps first
        (a prefill whose steps hand its requests off to its ranks)."""
        seen = c1.FinishedRequests()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for other in also:
                other.step()
            f = self.step()
            seen.finished_sending |= f.finished_sending
            seen.finished_recving |= f.finished_recving
            seen.outcomes.update(f.outcomes)
            if pred(seen):
                return seen
            time.sleep(0.01)
        raise AssertionError(f"{self.config.instance_id}: not reached within {timeout} s: {seen}")

    def fill(self, rid_blocks, n, seed, first_token=0):
        for layout, kv in zip(self.layouts, self.caches):
            kvbridge.fill_request(layout, kvbridge.Request(n, {"full": (rid_blocks, [])}), kv, side="local",
                                  first_token=first_token, seed=seed)

    def check(self, rid_blocks, n, seed, first_token=0):
        for layout, kv in zip(self.layouts, self.caches):
            report = kvbridge.check_request(layout, kvbridge.Request(n, {"full": (rid_blocks, [])}), kv, side="local",
                                            first_token=first_token, seed=seed)
            assert report.ok and report.cells > 0, report.first_error

    def close(self):
        for w in self.workers:
            w.close()
        for ptr in self.ptrs:
            kvbridge.testing.device_free(ptr)
        self.ptrs = []


@pytest.fixture
def pd():
    made = []

    def make(prefill_kw=None, decode_kw=None, prefill_tp=1, decode_tp=2):
        p = Instance("prefill", "prefill", prefill_tp, 16, **(prefill_kw or {}))
        d = Instance("decode", "decode", decode_tp, 32, **(decode_kw or {}))
        made.extend([p, d])
        return p, d

    yield make
    for inst in made:
        inst.close()


def prefill_request(p, rid, prompt, blocks, seed, **params):
    """Prefill runs a request handed over to decode; returns the params the router forwards."""
    n, is_async = p.scheduler.get_num_new_matched_tokens(rid, prompt, 0, {"do_remote_decode": True, **params})
    assert not is_async
    p.scheduler.update_state_after_alloc(rid, blocks, n)
    p.fill(blocks, len(prompt), seed)
    p.step()
    delay_free, out = p.scheduler.request_finished(rid, blocks)
    assert delay_free and out["do_remote_prefill"] and out["remote_num_tokens"] == len(prompt)
    return out


def test_pd_tp1_to_tp2_16_to_32_token_blocks_byte_exact_and_prefill_freed(pd):
    p, d = pd()
    prompt = list(range(100, 140))  # 40 tokens
    params = prefill_request(p, "req-1", prompt, [3, 4, 5], seed=11)
    params = pickle.loads(pickle.dumps(params))  # through the router
    assert d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, params) == (40, True)
    d.scheduler.update_state_after_alloc("req-1", [6, 2], 40)
    seen = d.run_until(lambda f: "req-1" in f.finished_recving)
    assert seen.outcomes["req-1"].outcome == "finished", seen.outcomes["req-1"].error
    d.check([6, 2], 40, seed=11)
    assert d.workers[0].get_block_ids_with_load_errors() == set()
    # Both decode ranks said done: the prefill blocks are free, once.
    seen = p.run_until(lambda f: "req-1" in f.finished_sending)
    assert p.scheduler.held == 0
    assert "req-1" not in p.step().finished_sending


def test_a_combined_load_reads_the_stored_prefix_from_the_store_and_only_the_rest_from_prefill(pd):
    store = {"store_hash_block_tokens": 16, "store_memory_bytes": 64 << 20}
    p, d = pd(prefill_kw=store, decode_kw=store)
    shared = list(range(500, 532))  # a 32-token prefix stored by an earlier request
    # An earlier request stores the prefix (seed 1), e.g. a previous turn on the decode instance.
    assert d.scheduler.get_num_new_matched_tokens("req-0", shared + [7], 0) == (0, False)
    d.scheduler.update_state_after_alloc("req-0", [9, 10], 0)
    d.fill([9, 10], 33, seed=1)
    assert d.scheduler.request_finished("req-0", [9, 10]) == (True, None)  # kept until stored
    d.run_until(lambda f: "req-0" in f.finished_sending)
    # Prefill computes the whole new prompt with other values (seed 2) in its blocks.
    prompt = shared + list(range(900, 924))  # 56 tokens
    params = prefill_request(p, "req-1", prompt, [1, 2, 3, 4], seed=2)
    n, is_async = d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, params)
    assert (n, is_async) == (56, True)
    d.scheduler.update_state_after_alloc("req-1", [4, 5], n)
    seen = d.run_until(lambda f: "req-1" in f.finished_recving)
    assert seen.outcomes["req-1"].outcome == "finished", seen.outcomes["req-1"].error
    d.check([4, 5], 32, seed=1)                   # the prefix: the store's bytes
    d.check([4, 5], 56, seed=2, first_token=32)   # the rest: prefill's
    # Reference: what the P/D part of a 56-token load moves when nothing is stored.
    full = kvbridge.plan(d.layouts[0], p.layouts, kvbridge.Request(56, {"full": ([4, 5], [1, 2, 3, 4])}))
    rest = kvbridge.plan(d.layouts[0], p.layouts, kvbridge.Request(56, {"full": ([4, 5], [1, 2, 3, 4])},
                                                                   skip_tokens=32))
    assert rest.bytes * 56 == full.bytes * 24
    p.run_until(lambda f: "req-1" in f.finished_sending)


def test_the_last_prompt_token_is_left_to_compute_and_a_store_hit_loads_synchronously(pd):
    store = {"store_hash_block_tokens": 16, "store_memory_bytes": 64 << 20}
    p, _ = pd(prefill_kw=store, decode_kw=store)  # p: 16-token blocks, so hits are multiples of 16
    prompt = list(range(50, 83))  # 33 tokens: two full hash blocks are stored
    assert p.scheduler.get_num_new_matched_tokens("req-a", prompt, 0) == (0, False)
    p.scheduler.update_state_after_alloc("req-a", [1, 2, 3], 0)
    p.fill([1, 2, 3], 33, seed=4)
    assert p.scheduler.request_finished("req-a", [1, 2, 3]) == (True, None)
    p.run_until(lambda f: "req-a" in f.finished_sending)
    # The same prompt again: 32 tokens from the store, loaded in the step's start_load_kv.
    assert p.scheduler.get_num_new_matched_tokens("req-b", prompt, 0) == (32, False)
    p.scheduler.update_state_after_alloc("req-b", [7, 8, 9], 32)
    p.step()
    p.check([7, 8, 9], 32, seed=4)
    assert all(w.get_block_ids_with_load_errors() == set() for w in p.workers)
    # Its first 32 tokens only: the last one is left to compute, so the hit is one block.
    assert p.scheduler.get_num_new_matched_tokens("req-c", prompt[:32], 0) == (16, False)
    # Tokens the engine has already (its own prefix cache) are not counted again.
    assert p.scheduler.get_num_new_matched_tokens("req-d", prompt, 16) == (16, False)


def test_a_dead_prefill_fails_the_load_and_names_the_blocks_to_recompute(pd):
    p, d = pd(decode_kw={"failure_policy": "recompute", "handshake_timeout_s": 1.0, "load_timeout_s": 5.0})
    prompt = list(range(64))
    params = prefill_request(p, "req-2", prompt, [1, 2, 3, 4], seed=3)
    p.close()  # prefill dies before decode reads
    d.scheduler.get_num_new_matched_tokens("req-2", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-2", [3, 4], 64)
    bad = set()
    deadline = time.monotonic() + 20
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        f = d.step()
        outcome = f.outcomes.get("req-2")
        for w in d.workers:
            bad |= w.get_block_ids_with_load_errors()
        time.sleep(0.01)
    assert outcome is not None and outcome.outcome == "recompute" and outcome.recompute_from == 0, outcome
    assert outcome.error.code in ("unavailable", "timeout", "io_error"), outcome.error
    for w in d.workers:
        bad |= w.get_block_ids_with_load_errors()
    assert bad == {3, 4}


def test_a_request_finished_while_loading_is_aborted_and_no_block_is_stranded(pd):
    p, d = pd()
    prompt = list(range(48))
    params3 = prefill_request(p, "req-3", prompt, [1, 2, 3], seed=5)
    params4 = prefill_request(p, "req-4", prompt, [4, 5, 6], seed=6)
    # Decode names the requests its own way (the prefill's ids travel as remote_request_id).
    d.scheduler.get_num_new_matched_tokens("d-3", prompt, 0, params3)
    d.scheduler.update_state_after_alloc("d-3", [1, 2], 48)
    # Finished (the client went away) before the load was handed to the ranks: the blocks are
    # free once the ranks told prefill, without reading, that they are done.
    assert d.scheduler.request_finished("d-3", [1, 2]) == (True, None)
    d.scheduler.get_num_new_matched_tokens("d-4", prompt, 0, params4)
    d.scheduler.update_state_after_alloc("d-4", [3, 4], 48)
    # Handed to the ranks: now loading, or loaded already, and then "d-3" (nothing to read) may
    # have ended in this very step.
    first = d.step()
    delay_free, _ = d.scheduler.request_finished("d-4", [3, 4])
    want = {"d-3", "d-4"} if delay_free else {"d-3"}
    seen = d.run_until(lambda f: want <= f.finished_sending | first.finished_sending)
    seen.outcomes.update(first.outcomes)
    assert all(o.outcome in ("aborted", "finished") for o in seen.outcomes.values()), seen.outcomes
    # Prefill hears from both decode ranks for both requests, well before the 30 s lease.
    seen = p.run_until(lambda f: {"req-3", "req-4"} <= f.finished_sending, timeout=15)
    assert p.scheduler.held == 0


def test_a_load_past_its_deadline_is_reported_only_once_no_rank_can_write_any_more(pd):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts connections, never answers: the handshake hangs
    try:
        _, d = pd(decode_kw={"load_timeout_s": 0.5, "handshake_timeout_s": 20.0})
        params = {"do_remote_prefill": True, "remote_instance": "silent", "remote_block_ids": [1],
                  "remote_addresses": [f"127.0.0.1:{silent.getsockname()[1]}"], "remote_num_tokens": 16}
        d.scheduler.get_num_new_matched_tokens("req-t", list(range(16)), 0, params)
        d.scheduler.update_state_after_alloc("req-t", [3], 16)
        t0 = time.monotonic()
        seen = d.run_until(lambda f: "req-t" in f.outcomes, timeout=10)
        # Failed at the deadline (not at the 20 s handshake timeout), once both ranks ended the load: each
        # aborted it, or (on a loaded machine) saw its own transfer timeout, equal to the deadline, first.
        assert time.monotonic() - t0 < 5
        o = seen.outcomes["req-t"]
        assert o.outcome == "failed" and o.error.code == "timeout", o
        ended = [(w.worker.stats().loads_aborted, w.worker.stats().loads_failed) for w in d.workers]
        assert all(a + f == 1 for a, f in ended), ended
    finally:
        silent.close()


def test_a_request_finished_after_its_load_ended_frees_at_once_and_a_lost_rank_is_not_waited_for(pd):
    p, d = pd()
    prompt = list(range(32))
    params = prefill_request(p, "req-5", prompt, [1, 2], seed=9)
    d.scheduler.get_num_new_matched_tokens("req-5", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-5", [1], 32)
    meta = d.scheduler.build_connector_meta()
    outputs = []
    for w in d.workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv()
    deadline = time.monotonic() + 20
    for w in d.workers:
        while not w.worker.wait_results(0.05) and time.monotonic() < deadline:
            pass
        outputs.append(w.build_connector_worker_meta())
    d.scheduler.update_connector_output(outputs)
    # Every rank reported, the outcome not taken yet: nothing is loading any more.
    assert d.scheduler.request_finished("req-5", [1]) == (False, None)
    assert d.scheduler.build_connector_meta().aborts == []
    # A rank lost while a load waits on it: the request fails naming it, without waiting for it.
    params = prefill_request(p, "req-6", prompt, [3, 4], seed=9)
    d.scheduler.get_num_new_matched_tokens("req-6", prompt, 0, params)
    d.scheduler.update_state_after_alloc("req-6", [2], 32)
    d.scheduler.build_connector_meta()  # handed to ranks that are gone
    d.scheduler.rank_lost(0, "worker process exited")
    d.scheduler.rank_lost(1, "worker process exited")
    f = d.scheduler.take_finished()
    assert f.outcomes["req-6"].outcome == "failed" and "worker process exited" in f.outcomes["req-6"].error.message


def test_layer_wise_streaming_reads_each_layer_as_prefill_saves_it(pd):
    p, d = pd(decode_kw={"stream": True})
    prompt = list(range(300, 332))
    stream_to = {"instance": "decode", "addresses": [w.get_handshake_metadata() for w in d.workers]}
    n, _ = p.scheduler.get_num_new_matched_tokens("req-s", prompt, 0, {"do_remote_decode": True,
                                                                       "stream_to": stream_to})
    p.scheduler.update_state_after_alloc("req-s", [5, 6], n)
    early = p.scheduler.transfer_params("req-s")  # the router forwards these before prefill computes
    assert early["stream"] and early["remote_block_ids"] == [5, 6]
    d.scheduler.get_num_new_matched_tokens("req-s", prompt, 0, early)
    d.scheduler.update_state_after_alloc("req-s", [1, 2], 32)
    meta = d.scheduler.build_connector_meta()
    assert meta.loads[0].stream
    for w in d.workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv()
    p.fill([5, 6], 32, seed=8)
    p.step()  # save_kv_layer announces each layer; decode reads it
    for w in d.workers:
        for layer in kvbridge.layer_order(w.layout):
            w.wait_for_layer_load(layer)
    seen = d.run_until(lambda f: "req-s" in f.finished_recving)
    assert seen.outcomes["req-s"].outcome == "finished", seen.outcomes["req-s"].error
    d.check([1, 2], 32, seed=8)
    assert p.scheduler.request_finished("req-s", [5, 6])[0]
    p.run_until(lambda f: "req-s" in f.finished_sending)


def test_bad_input_is_refused_naming_what_is_wrong(pd):
    with pytest.raises(kvbridge.InvalidArgument, match="role 'router'"):
        c1.ConnectorConfig(instance_id="x", role="router")
    with pytest.raises(kvbridge.InvalidArgument, match="instance_id"):
        c1.ConnectorConfig(instance_id="a b")
    with pytest.raises(kvbridge.InvalidArgument, match="cache_layout"):
        c1.ConnectorConfig(instance_id="x", cache_layout="nhd")
    with pytest.raises(kvbridge.InvalidArgument, match="failure_policy"):
        c1.ConnectorConfig(instance_id="x", failure_policy="retry")
    with pytest.raises(kvbridge.InvalidArgument, match="rank 2"):
        c1.WorkerConnector(c1.ConnectorConfig(instance_id="x", tp_size=2), 2)
    with pytest.raises(kvbridge.InvalidArgument, match="store needs"):
        c1.SchedulerConnector(c1.ConnectorConfig(instance_id="x", store_hash_block_tokens=16))
    with pytest.raises(kvbridge.InvalidArgument, match="decode_ranks 2: the number of decode ranks"):
        c1.ConnectorConfig(instance_id="x", decode_ranks=2)
    p, d = pd()
    with pytest.raises(kvbridge.InvalidArgument, match="remote_block_ids"):
        d.scheduler.get_num_new_matched_tokens("r", [1, 2], 0, {"do_remote_prefill": True, "remote_instance": "p",
                                                                "remote_addresses": [], "remote_num_tokens": 2})
    with pytest.raises(kvbridge.InvalidArgument, match="role is 'prefill'"):
        p.scheduler.get_num_new_matched_tokens("r", [1], 0, {"do_remote_prefill": True})
    with pytest.raises(kvbridge.InvalidArgument, match="2 rank addresses"):
        p.scheduler.set_xfer_handshake_metadata(["a:1", "b:2"])
    w = c1.WorkerConnector(c1.ConnectorConfig(instance_id="y"), 0)
    with pytest.raises(kvbridge.InvalidArgument, match="not flash_attn"):
        w.register_kv_caches({"l0": torch.zeros((4, 16, 2, 8))})
    with pytest.raises(kvbridge.InvalidArgument, match="register_kv_caches"):
        w.start_load_kv()
    # A remote address that is not host:port fails that request's load, not the step.
    params = {"do_remote_prefill": True, "remote_instance": "elsewhere", "remote_addresses": ["nowhere"],
              "remote_block_ids": [1], "remote_num_tokens": 16}
    d.scheduler.get_num_new_matched_tokens("req-x", list(range(16)), 0, params)
    d.scheduler.update_state_after_alloc("req-x", [1], 16)
    seen = d.run_until(lambda f: "req-x" in f.outcomes)
    assert seen.outcomes["req-x"].outcome == "failed" and "nowhere" in seen.outcomes["req-x"].error.message


def test_metadata_and_outputs_pickle():
    meta = c1.ConnectorMetadata(loads=[c1.LoadSpec("r", [1, 2], 32, remote_instance="p", remote_addresses=["h:1"],
                                                   remote_blocks=[3, 4])], aborts=["q"])
    assert pickle.loads(pickle.dumps(meta)) == meta
    out = c1.WorkerOutput(1, load_results=[kvbridge.LoadResult("r")], reader_events=[kvbridge.ReaderEvent("done", "r", "d/r0")])
    back = pickle.loads(pickle.dumps(out))
    assert back.rank == 1 and back.load_results[0].request == "r" and back.reader_events[0].reader == "d/r0"


def test_examples_connector_v1_two_processes():
    out = subprocess.run([sys.executable, str(EXAMPLES / "connector_v1_pd.py")], env=dict(os.environ),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decode: req-1 finished on 2 ranks" in out.stdout
    assert "compared byte-exact: OK" in out.stdout
    assert "prefill: req-1 blocks freed" in out.stdout


def test_examples_stream_ready_streams_device_kv_after_each_layers_event():
    """examples/stream_ready.py: layers queued behind slow kernels (the host fake here), each
    announced at once with its event; every byte the decode reads is checked."""
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "stream_ready.py")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, KVB_DEVICE="fake"))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "4 layers x 48 tokens compared: OK" in r.stdout, r.stdout
    assert "parent: streamed with readiness: OK" in r.stdout, r.stdout

"""Connector roles: the schedulers, and workers doing P/D in one process
(the two-process torch transfer is test_pd_torch.py)."""
import pickle
import time

import numpy as np
import pytest
import torch

import kvbridge
from conftest import NUM_BLOCKS, torch_caches, torch_spec


def test_prefill_scheduler_releases_once_when_every_reader_is_done():
    s = kvbridge.PrefillScheduler(lease=10.0)
    now = time.monotonic()
    s.hold("req-1", {"d0", "d1"}, now=now)
    assert s.held == 1 and s.next_expiry() == pytest.approx(now + 10.0, abs=1e-3)
    s.heartbeat("req-1", "d0", now=now + 1)
    s.reader_done("req-1", "d0", now=now + 2)
    assert s.take_releases(now=now + 2) == []
    s.reader_done("req-1", "d1", now=now + 3)
    (r,) = s.take_releases(now=now + 3)
    assert (r.request, r.reason, r.readers_missing) == ("req-1", "read", [])
    assert s.take_releases(now=now + 100) == []


def test_prefill_scheduler_lease_expiry_names_missing_readers():
    s = kvbridge.PrefillScheduler(lease=1.0)
    now = time.monotonic()
    s.hold("req-2", {"d0"}, now=now)
    (r,) = s.take_releases(now=now + 2)
    assert r.reason == "lease_expired" and r.readers_missing == ["d0"]


def test_decode_scheduler_policies():
    s = kvbridge.DecodeScheduler(ranks=2, policy="recompute")
    s.expect("req-1", skip_tokens=16, timeout=10)
    s.rank_result(0, kvbridge.LoadResult("req-1"))
    s.rank_result(1, kvbridge.LoadResult("req-1", kvbridge.Status("unavailable", "peer gone"), first_bad_token=32))
    (o,) = s.take_outcomes()
    assert (o.outcome, o.recompute_from, o.error.message) == ("recompute", 32, "decode rank 1: peer gone")
    f = kvbridge.DecodeScheduler(ranks=1)
    f.expect("req-2", deadline=time.monotonic() - 1)
    (o,) = f.take_outcomes()
    assert o.outcome == "failed" and o.error.code == "timeout"
    with pytest.raises(kvbridge.NotFound):
        f.rank_result(0, kvbridge.LoadResult("req-99"))
    with pytest.raises(kvbridge.InvalidArgument):
        kvbridge.DecodeScheduler(1, policy="maybe")


@pytest.fixture
def workers():
    """A prefill and a decode worker over torch caches in this process."""
    p, d = torch_caches(fill_seed=3), torch_caches()
    lp, ld = kvbridge.layout_from_tensors(torch_spec(p)), kvbridge.layout_from_tensors(torch_spec(d))
    with kvbridge.Engine(name="prefill/r0") as ep, kvbridge.Engine(name="decode/r0") as ed:
        with kvbridge.ConnectorWorker(ep, lp, p, instance_id="prefill", heartbeat_interval=0.05) as wp, \
                kvbridge.ConnectorWorker(ed, ld, {n: t for n, t in zip(ld.tensor_names, d)},
                                         instance_id="decode") as wd:
            wd.add_remote("prefill", [wp.side_channel_address])
            yield p, d, wp, wd


def test_load_moves_blocks_and_readers_report_done(workers):
    p, d, wp, wd = workers
    wd.start_load("req-5", "prefill", kvbridge.Request(24, {"full": ([2, 3], [6, 1])}))
    result = wd.collect(["req-5"], timeout=20)["req-5"]
    assert result.ok and result.sources == [0] and result.bytes > 0, result
    for got, want in zip(d, p):
        assert torch.equal(got[:, 2].view(torch.int16), want[:, 6].view(torch.int16))
        assert torch.equal(got[:, 3, :8].view(torch.int16), want[:, 1, :8].view(torch.int16))
        assert not got[:, 3, 8:].view(torch.int16).any()
    deadline = time.monotonic() + 10
    events = []
    while not any(e.kind == "done" for e in events) and time.monotonic() < deadline:
        events += wp.take_reader_events()
        time.sleep(0.01)
    assert any(e.kind == "done" and e.request == "req-5" and e.reader == "decode/r0" for e in events)
    assert wd.stats().handshakes == 1 and wp.stats().handshakes_served == 1
    (view,) = kvbridge.testing.remote_ranks(wd, "prefill")
    assert view.layout == wp.layout and len(view.tensor_bases) == len(p)


def test_wait_results_and_take_results(workers):
    _, _, _, wd = workers
    wd.start_load("req-6", "prefill", kvbridge.Request(16, {"full": ([0], [0])}))
    assert wd.wait_results(timeout=20)
    (r,) = wd.take_results()
    assert r.request == "req-6" and r.ok and r.transfer_time >= 0
    assert 0 <= r.last_stage_time <= r.transfer_time
    assert not wd.wait_results(timeout=0.05)
    with pytest.raises(kvbridge.Timeout, match="request"):
        wd.collect("req-77", timeout=0.1)
    with pytest.raises(kvbridge.NotFound):
        wd.abort("req-12345")


def test_a_streamed_load_reads_each_layer_once_the_prefill_saved_it():
    p, d = torch_caches(fill_seed=5), torch_caches()
    lp, ld = kvbridge.layout_from_tensors(torch_spec(p)), kvbridge.layout_from_tensors(torch_spec(d))
    layers = kvbridge.layer_order(ld)
    assert len(layers) == 2
    with kvbridge.Engine(name="prefill/r0") as ep, kvbridge.Engine(name="decode/r0") as ed:
        with kvbridge.ConnectorWorker(ep, lp, p, instance_id="prefill") as wp, \
                kvbridge.ConnectorWorker(ed, ld, d, instance_id="decode", remote_access="none") as wd:
            wd.add_remote("prefill", [wp.side_channel_address])
            wp.add_remote("decode", [wd.side_channel_address])
            wd.start_load("req-9", "prefill", kvbridge.Request(32, {"full": ([1, 2], [4, 5])}), stream=True)
            wp.stream_to("req-9", "decode")
            with pytest.raises(kvbridge.Timeout):
                wd.wait_for_layer("req-9", layers[0], timeout=0.05)
            wp.save_layer("req-9", layers[0])
            wd.wait_for_layer("req-9", layers[0], timeout=10)
            assert torch.equal(d[0][:, 1].view(torch.int16), p[0][:, 4].view(torch.int16))
            assert not d[1].view(torch.int16).any()  # not saved yet: not read
            wp.save_layer("req-9", layers[1])
            result = wd.collect("req-9", timeout=20)["req-9"]
            assert result.ok and result.stages == 2 and result.first_bad_layer == "", result
            assert torch.equal(d[1][:, 2].view(torch.int16), p[1][:, 5].view(torch.int16))
            wp.wait_for_save("req-9", timeout=10)
            with pytest.raises(kvbridge.InvalidArgument, match="no layer"):
                wp.save_layer("req-9", "nope")


def test_push_mode_the_prefill_writes_layer_by_layer_and_the_decode_reads_nothing():
    p, d = torch_caches(fill_seed=7), torch_caches()
    lp, ld = kvbridge.layout_from_tensors(torch_spec(p)), kvbridge.layout_from_tensors(torch_spec(d))
    layers = kvbridge.layer_order(ld)
    with kvbridge.Engine(name="prefill/r0") as ep, kvbridge.Engine(name="decode/r0") as ed:
        with kvbridge.ConnectorWorker(ep, lp, p, instance_id="prefill", mode="push", remote_access="none") as wp, \
                kvbridge.ConnectorWorker(ed, ld, d, instance_id="decode", mode="push", remote_access="granted_write") as wd:
            wd.add_remote("prefill", [wp.side_channel_address])
            wp.add_remote("decode", [wd.side_channel_address])
            wp.add_remote("prefill", [wp.side_channel_address])  # it plans over its own instance's ranks
            q = kvbridge.Request(32, {"full": ([1, 2], [4, 5])})
            wd.start_load("req-3", "prefill", q, stream=True)
            wp.push("req-3", "decode", q, stream=True)
            wp.save_layer("req-3", layers[0])
            wd.wait_for_layer("req-3", layers[0], timeout=10)
            assert torch.equal(d[0][:, 1].view(torch.int16), p[0][:, 4].view(torch.int16))
            assert not d[1].view(torch.int16).any()  # not saved yet: not written
            wp.save_layer("req-3", layers[1])
            result = wd.collect("req-3", timeout=20)["req-3"]
            assert result.ok and result.stages == 2, result
            assert torch.equal(d[1][:, 2].view(torch.int16), p[1][:, 5].view(torch.int16))
            wp.wait_for_save("req-3", timeout=10)
            with pytest.raises(kvbridge.InvalidArgument, match="pull mode"):
                wp.stream_to("req-4", "decode")
        with pytest.raises(kvbridge.InvalidArgument, match="transfer mode 'sideways'"):
            kvbridge.ConnectorWorker(ed, ld, d, instance_id="decode", mode="sideways")


def test_a_mismatched_handshake_raises_incompatible_naming_the_field():
    p, d = torch_caches(fill_seed=1), torch_caches()
    lp, ld = kvbridge.layout_from_tensors(torch_spec(p)), kvbridge.layout_from_tensors(torch_spec(d, dtype="fp8_e4m3"))
    with kvbridge.Engine(name="prefill/r0") as ep, kvbridge.Engine(name="decode/r0") as ed, \
            kvbridge.ConnectorWorker(ep, lp, p, instance_id="prefill") as wp, \
            kvbridge.ConnectorWorker(ed, ld, d, instance_id="decode") as wd:
        wd.add_remote("prefill", [wp.side_channel_address])
        # The handshake runs on the worker's connect thread: its error is the load's result.
        wd.start_load("req-1", "prefill", kvbridge.Request(16, {"full": ([0], [0])}))
        r = wd.collect("req-1", timeout=20)["req-1"]
        assert not r.ok and r.error.code == "incompatible" and "dtype differs" in r.error.message
        with pytest.raises(kvbridge.Incompatible, match="dtype differs") as e:
            wd.wait_connected("prefill", timeout=20)
        assert e.value.code == "incompatible"


def test_worker_checks_memory_and_holds_its_engine():
    d = torch_caches()
    ld = kvbridge.layout_from_tensors(torch_spec(d))
    with kvbridge.Engine(name="w") as e:
        with pytest.raises(kvbridge.InvalidArgument):
            kvbridge.ConnectorWorker(e, ld, d[:1], instance_id="x")
        with pytest.raises(kvbridge.NotFound, match="kv.1"):
            kvbridge.ConnectorWorker(e, ld, {"kv.0": d[0]}, instance_id="x")
        w = kvbridge.ConnectorWorker(e, ld, d, instance_id="x")
        with pytest.raises(kvbridge.Unavailable, match="ConnectorWorker"):
            e.close()  # the worker is still open
        w.close()
        with pytest.raises(kvbridge.Unavailable):
            w.stats()


def test_verify_plans_checks_each_plan_before_it_runs():
    p, d = torch_caches(fill_seed=4), torch_caches()
    lp, ld = kvbridge.layout_from_tensors(torch_spec(p)), kvbridge.layout_from_tensors(torch_spec(d))
    with kvbridge.Engine(name="prefill/r0") as ep, kvbridge.Engine(name="decode/r0") as ed:
        with kvbridge.ConnectorWorker(ep, lp, p, instance_id="prefill") as wp, \
                kvbridge.ConnectorWorker(ed, ld, d, instance_id="decode", verify_plans=True) as wd:
            wd.add_remote("prefill", [wp.side_channel_address])
            wd.start_load("req-7", "prefill", kvbridge.Request(24, {"full": ([2, 3], [6, 1])}))
            assert wd.collect(["req-7"], timeout=20)["req-7"].ok
            assert (wd.stats().plans_verified, wd.stats().plans_rejected) == (1, 0)
            # The first load of its shape is planned as it comes, no template built.
            assert (wd.stats().plan_templates, wd.stats().plans_not_templated) == (0, 1)


def test_verify_content_hashes_every_byte_a_load_moves_over_tcp():
    p, d = torch_caches(fill_seed=4), torch_caches()
    lp, ld = kvbridge.layout_from_tensors(torch_spec(p)), kvbridge.layout_from_tensors(torch_spec(d))
    with kvbridge.Engine(name="prefill/r0", transports=["tcp"]) as ep, \
            kvbridge.Engine(name="decode/r0", transports=["tcp"]) as ed:
        with kvbridge.ConnectorWorker(ep, lp, p, instance_id="prefill") as wp, \
                kvbridge.ConnectorWorker(ed, ld, d, instance_id="decode", verify_content=True) as wd:
            wd.add_remote("prefill", [wp.side_channel_address])
            wd.start_load("req-7", "prefill", kvbridge.Request(24, {"full": ([2, 3], [6, 1])}))
            assert wd.collect(["req-7"], timeout=20)["req-7"].ok
            m = ed.metrics()
            # Every byte read was hashed by the prefill's server and here, and matched.
            assert m.bytes_content_checked == m.bytes_read > 0 and m.content_check_failures == 0


def test_add_remote_refuses_an_address_that_is_not_host_port(workers):
    _, _, _, wd = workers
    with pytest.raises(kvbridge.InvalidArgument, match="side channel address of instance 'other' rank 0"):
        wd.add_remote("other", ["stop"])


def test_results_and_events_cross_a_process_boundary():
    """What a worker process hands the scheduler's process pickles whole."""
    import multiprocessing
    import pickle
    st = kvbridge.Status("timeout", "prefill rank 1: deadline")
    assert pickle.loads(pickle.dumps(st)) == st
    r = kvbridge.LoadResult("req-7", st, first_bad_token=32)
    back = pickle.loads(pickle.dumps(r))
    assert back == r and back.error == st and back.first_bad_token == 32 and back.sources == r.sources
    e = kvbridge.ReaderEvent("done", "req-7", "decode/r0")
    assert pickle.loads(pickle.dumps(e)) == e and e.kind == "done" and e.reader == "decode/r0"
    with pytest.raises(kvbridge.InvalidArgument, match="neither 'heartbeat' nor 'done'"):
        kvbridge.ReaderEvent("finished", "req-7", "decode/r0")
    # Through a real pipe between processes, into the schedulers.
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=lambda c: c.send([kvbridge.LoadResult("req-9", first_bad_token=0),
                                                kvbridge.ReaderEvent("done", "req-9", "decode/r0")]), args=(child,))
    proc.start()
    got_result, got_event = parent.recv()
    proc.join(10)
    ds = kvbridge.DecodeScheduler(ranks=1)
    ds.expect("req-9")
    ds.rank_result(0, got_result)
    (o,) = ds.take_outcomes()
    assert o.outcome == "finished" and pickle.loads(pickle.dumps(o)) == o
    ps = kvbridge.PrefillScheduler()
    ps.hold("req-9", {"decode/r0"})
    ps.reader_done(got_event.request, got_event.reader)
    (rel,) = ps.take_releases()
    assert rel.reason == "read" and pickle.loads(pickle.dumps(rel)) == rel


def test_request_ids_are_strings_and_ints_are_taken_as_their_decimal_text():
    s = kvbridge.PrefillScheduler(lease=1.0)
    now = 100.0
    s.hold("chatcmpl-7f3a/0", {"d0"}, now=now)
    s.hold(42, {"d0"}, now=now)  # an engine with integer ids
    s.reader_done("chatcmpl-7f3a/0", "d0", now=now)
    s.reader_done("42", "d0", now=now)
    assert sorted(r.request for r in s.take_releases(now=now)) == ["42", "chatcmpl-7f3a/0"]
    with pytest.raises(kvbridge.InvalidArgument, match="request id 'a b' has a space at byte 1"):
        s.hold("a b", {"d0"}, now=now)
    with pytest.raises(kvbridge.InvalidArgument, match="request id is empty"):
        kvbridge.DecodeScheduler(1).expect("")
    with pytest.raises(TypeError):
        s.hold(1.5, {"d0"}, now=now)
    r = kvbridge.LoadResult(7)
    assert r.request == "7" and pickle.loads(pickle.dumps(r)).request == "7"


def test_hold_by_reader_count_when_the_readers_are_not_known_yet():
    # request_finished runs before the decode instance is chosen: hold by
    # count (readers_per_source() says how many decode ranks read this rank).
    prefill = [kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=r, num_blocks=8) for r in range(2)]
    decode = [kvbridge.make_preset("llama3-8b", tp_size=4, tp_rank=r, num_blocks=8) for r in range(4)]
    count = len(kvbridge.readers_per_source(decode, prefill)[1])
    assert count == 2
    s = kvbridge.PrefillScheduler(lease=5.0)
    s.hold("req-1", count, now=0.0)
    s.reader_done("req-1", "decode-7/r2", now=1.0)
    s.reader_done("req-1", "decode-7/r2", now=1.0)  # once per engine
    assert s.take_releases(now=1.0) == []
    s.reader_done("req-1", "decode-7/r3", now=2.0)
    (r,) = s.take_releases(now=2.0)
    assert (r.request, r.reason, r.missing_count) == ("req-1", "read", 0)
    s.hold("req-2", 2, now=0.0)
    (late,) = s.take_releases(now=6.0)
    assert late.reason == "lease_expired" and late.missing_count == 2
    assert pickle.loads(pickle.dumps(late)) == late
    with pytest.raises(kvbridge.InvalidArgument, match="no expected reader"):
        s.hold("req-3", 0, now=0.0)

"""Plans as zero-copy numpy views, the verifier, and deterministic content."""
import gc
import json

import numpy as np
import pytest

import kvbridge
from conftest import host_arrays


def test_descriptors_are_a_zero_copy_read_only_view_that_keeps_the_plan_alive(small_layout):
    request = kvbridge.Request(40, {"full": ([0, 1, 2], [4, 5, 6])})
    p = kvbridge.plan(small_layout, [small_layout], request)
    d = p.descriptors
    assert d.dtype == kvbridge.descriptor_dtype and d.dtype.itemsize == 32
    assert d.dtype.names == ("source", "local_tensor", "remote_tensor", "reserved", "local_offset",
                             "remote_offset", "bytes")
    assert len(d) == len(p) and int(d["bytes"].sum()) == p.bytes
    assert d.base is p and not d.flags.writeable and not d.flags.owndata
    assert np.shares_memory(d, p.descriptors)  # every access views the same memory
    with pytest.raises(ValueError):
        d["bytes"][0] = 1
    before = d.copy()
    del p
    gc.collect()
    assert np.array_equal(d, before)  # the view kept the plan alive
    assert p_sources_ok(small_layout, request)


def p_sources_ok(layout, request):
    p = kvbridge.plan(layout, [layout], request)
    (s,) = p.sources
    return s.tp_rank == 0 and s.bytes == p.bytes and s.descriptors == len(p)


def test_plan_merges_and_verifies(small_layout):
    request = kvbridge.Request(48, {"full": ([0, 1, 2], [4, 5, 6])})
    p = kvbridge.plan(small_layout, [small_layout], request)
    naive = kvbridge.naive_descriptor_count(small_layout, [small_layout], request)
    assert len(p) < naive
    report = kvbridge.verify(p, small_layout, [small_layout], request)
    assert report.bytes_checked == p.bytes == report.bytes_written


def test_heterogeneous_tp_plan_reads_from_both_prefill_ranks():
    prefill = [kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=r, num_blocks=8, block_tokens=16)
               for r in range(2)]
    decode = kvbridge.make_preset("llama3-8b", tp_size=1, num_blocks=8, block_tokens=32, order="LBNHC")
    request = kvbridge.Request(64, {"full": ([1, 2], [0, 1, 2, 3])})
    p = kvbridge.plan(decode, prefill, request)
    assert sorted(set(p.descriptors["source"].tolist())) == [0, 1]
    assert [s.tp_rank for s in p.sources] == [0, 1]
    kvbridge.verify(p, decode, prefill, request)
    doc = json.loads(p.to_json(decode, prefill, items=True, verified=1))
    assert doc["format"] == "kvbridge.plan/1"


def test_transfer_items_name_regions(small_layout):
    request = kvbridge.Request(16, {"full": ([0], [1])})
    p = kvbridge.plan(small_layout, [small_layout], request)
    n = len(small_layout.tensors)
    items = p.transfer_items(0, list(range(100, 100 + n)), list(range(200, 200 + n)))
    assert items.shape == (len(p), 5) and items.dtype == np.uint64
    d = p.descriptors
    assert np.array_equal(items[:, 0], d["local_tensor"] + 100)
    assert np.array_equal(items[:, 4], d["bytes"])


def test_fill_and_check_content_across_geometries():
    prefill = kvbridge.make_preset("llama3-8b", num_blocks=4, block_tokens=16)
    decode = kvbridge.make_preset("llama3-8b", num_blocks=4, block_tokens=32, order="LBNHC")
    request = kvbridge.Request(40, {"full": ([1, 2], [0, 1, 3])})
    src, dst = host_arrays(prefill), host_arrays(decode)
    kvbridge.fill_request(prefill, request, src, side="remote", seed=9)
    p = kvbridge.plan(decode, [prefill], request)
    for d in p.descriptors:  # execute the plan with numpy
        o, r, n = int(d["local_offset"]), int(d["remote_offset"]), int(d["bytes"])
        dst[d["local_tensor"]][o:o + n] = src[d["remote_tensor"]][r:r + n]
    report = kvbridge.check_request(decode, request, dst, side="local", seed=9)
    assert report.ok and report.bytes == p.bytes
    dst[0][:] = 0
    bad = kvbridge.check_request(decode, request, dst, seed=9)
    assert bad.bad_cells > 0 and "tensor 'kv.0'" in bad.first_error
    with pytest.raises(kvbridge.InvalidArgument):
        kvbridge.check_request(decode, request, dst[:-1])


def test_source_ranks_are_the_fewest_and_readers_are_counted():
    # glm5-flash: MLA and indexer replicated, KDA state sharded. Decode TP 2
    # rank 1 needs prefill TP 4 ranks 2 and 3 alone.
    prefill = [kvbridge.make_preset("glm5-flash", tp_size=4, tp_rank=r, num_blocks=8) for r in range(4)]
    decode = [kvbridge.make_preset("glm5-flash", tp_size=2, tp_rank=r, num_blocks=8) for r in range(2)]
    assert kvbridge.source_ranks(decode[1], prefill) == [2, 3]
    assert kvbridge.source_ranks(decode[0], prefill) == [0, 1]
    assert kvbridge.readers_per_source(decode, prefill) == {0: [0], 1: [0], 2: [1], 3: [1]}
    with pytest.raises(kvbridge.Incompatible, match="global head"):
        kvbridge.source_ranks(decode[1], prefill[:3])


def test_pipeline_stages_plan_and_verify():
    # Prefill in 2 pipeline stages of TP 2, decode TP 1 holding every layer.
    prefill = [kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=t, pp_size=2, pp_rank=s, num_blocks=8)
               for s in range(2) for t in range(2)]
    decode = kvbridge.make_preset("llama3-8b", num_blocks=8, block_tokens=32)
    assert [p.rank for p in prefill] == [0, 1, 2, 3]
    assert sum(l.held for l in prefill[2].groups[0].layers) == 16
    request = kvbridge.Request(64, {"full": ([0, 1], [2, 3, 4, 5])})
    p = kvbridge.plan(decode, prefill, request)
    assert kvbridge.verify(p, decode, prefill, request).bytes_written == p.bytes
    assert kvbridge.source_ranks(decode, prefill) == [0, 1, 2, 3]
    with pytest.raises(kvbridge.Incompatible, match="no given remote rank holds the layer"):
        kvbridge.plan(decode, prefill[:2], request)


def test_context_shards_plan_and_verify():
    # Decode TP 2 with DCP 2: each rank holds every other 16-token chunk of
    # each request, in a list as long as shard 0 needs.
    prefill = [kvbridge.make_preset("llama3-8b", num_blocks=8)]
    decode = [kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=r, dcp_size=2, dcp_interleave=16, num_blocks=8)
              for r in range(2)]
    g = decode[1].groups[0]
    assert g.context == kvbridge.ContextShard(2, 1, 16) and g.context.sharded()
    assert g.context.shard_of(17) == 1 and g.context.local_of(17) == 1 and g.context.global_of(1) == 17
    assert g.entries_for_tokens(40) == 2 and prefill[0].groups[0].entries_for_tokens(40) == 3
    assert decode[1].to_dict()["format"] == "kvbridge.layout/3"
    assert kvbridge.Layout.from_json(decode[1].to_json()) == decode[1]
    request = kvbridge.Request(40, {"full": ([0, 1], [2, 3, 4])})
    for d in decode:
        p = kvbridge.plan(d, prefill, request)
        assert kvbridge.verify(p, d, prefill, request).bytes_written == p.bytes
    # Shard 0 holds tokens 0..15 and 32..39, shard 1 tokens 16..31.
    b0 = kvbridge.plan(decode[0], prefill, request).bytes
    b1 = kvbridge.plan(decode[1], prefill, request).bytes
    assert b0 * 16 == b1 * 24
    with pytest.raises(kvbridge.InvalidArgument, match="--dcp 3"):
        kvbridge.make_preset("llama3-8b", tp_size=2, dcp_size=3)

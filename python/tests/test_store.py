"""The prefix store from Python: put from one rank's torch tensors, get into
ranks of another geometry, byte-exact; errors name what is wrong."""
import numpy as np
import pytest
import torch

import kvbridge


def test_put_then_get_into_ranks_of_another_tp_and_block_size_byte_exact():
    store = kvbridge.Store(hash_block_tokens=16, memory_bytes=64 << 20)
    writer = kvbridge.make_preset("llama3-8b", num_blocks=8)
    wmem = [torch.zeros(t.bytes, dtype=torch.uint8) for t in writer.tensors]
    tokens = torch.arange(1000, 1064, dtype=torch.int64)
    q = kvbridge.Request(64, {"full": ([3, 1, 4, 5], [])})
    kvbridge.fill_request(writer, q, wmem, side="local", seed=5)
    w = kvbridge.RankStore(store, writer, wmem)
    put = w.put(tokens, q)
    assert put.objects_published == 4 and put.bytes_copied > 0
    assert w.put(tokens, q).objects_present == 4  # already there
    assert w.lookup(tokens).hit_tokens == 64
    assert w.lookup(tokens, limit_tokens=40).hit_tokens == 32
    assert w.lookup(list(range(64))).hit_tokens == 0  # other tokens: a miss
    # Decode TP 2 with 32-token blocks, numpy memory: each rank gets its heads.
    for r in range(2):
        reader = kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=r, num_blocks=8, block_tokens=32)
        rmem = [np.zeros(t.bytes, dtype=np.uint8) for t in reader.tensors]
        rq = kvbridge.Request(64, {"full": ([6, 2], [])})
        got = kvbridge.RankStore(store, reader, rmem).get(tokens.numpy(), rq)
        assert got.hit_tokens == 64 and got.memory_objects == 4
        report = kvbridge.check_request(reader, rq, rmem, side="local", seed=5)
        assert report.bad_cells == 0 and report.cells > 0, report.first_error
    stats = store.stats()
    assert stats["memory_objects"] == 4 and stats["memory_hits"] >= 8 and not stats["redis_configured"]


def test_store_errors_name_what_is_wrong():
    with pytest.raises(kvbridge.InvalidArgument, match="hash_block_tokens"):
        kvbridge.Store(hash_block_tokens=0)
    with pytest.raises(kvbridge.InvalidArgument, match="assembly 'both'"):
        kvbridge.Store(assembly="both")
    with pytest.raises(kvbridge.InvalidArgument, match="redis"):
        kvbridge.Store(redis="nowhere")
    store = kvbridge.Store(hash_block_tokens=16, memory_bytes=8 << 20)
    shard = kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=1, dcp_size=2, num_blocks=8)
    with pytest.raises(kvbridge.InvalidArgument, match="context shard 1 of 2"):
        kvbridge.RankStore(store, shard, [np.zeros(t.bytes, dtype=np.uint8) for t in shard.tensors])
    layout = kvbridge.make_preset("llama3-8b", num_blocks=8)
    rs = kvbridge.RankStore(store, layout, [np.zeros(t.bytes, dtype=np.uint8) for t in layout.tensors])
    with pytest.raises(kvbridge.InvalidArgument, match="tokens"):
        rs.lookup(["a", "b"])
    with pytest.raises(kvbridge.InvalidArgument):
        rs.put(list(range(16)), kvbridge.Request(32, {"full": ([0, 1], [])}))  # more tokens than given


def test_a_rank_store_without_tensors_looks_up_only():
    store = kvbridge.Store(hash_block_tokens=16, memory_bytes=8 << 20)
    layout = kvbridge.make_preset("llama3-8b", num_blocks=8)
    mem = [np.zeros(t.bytes, dtype=np.uint8) for t in layout.tensors]
    kvbridge.fill_request(layout, kvbridge.Request(32, {"full": ([0, 1], [])}), mem, side="local", seed=2)
    kvbridge.RankStore(store, layout, mem).put(list(range(32)), kvbridge.Request(32, {"full": ([0, 1], [])}))
    scheduler_view = kvbridge.RankStore(store, layout)  # a scheduler process: no KV of its own
    assert scheduler_view.lookup(list(range(32))).hit_tokens == 32
    with pytest.raises(kvbridge.InvalidArgument, match=r"RankStore.get\(\): .*without tensors"):
        scheduler_view.get(list(range(32)), kvbridge.Request(32, {"full": ([2, 3], [])}))
    with pytest.raises(kvbridge.InvalidArgument, match=r"RankStore.put\(\): .*lookups only"):
        scheduler_view.put(list(range(32)), kvbridge.Request(32, {"full": ([2, 3], [])}))


def test_a_disk_tier_serves_a_later_store_and_holds_its_directory(tmp_path):
    writer = kvbridge.make_preset("llama3-8b", num_blocks=8)
    wmem = [torch.zeros(t.bytes, dtype=torch.uint8) for t in writer.tensors]
    tokens = torch.arange(2000, 2064, dtype=torch.int64)
    q = kvbridge.Request(64, {"full": ([3, 1, 4, 5], [])})
    kvbridge.fill_request(writer, q, wmem, side="local", seed=9)
    store = kvbridge.Store(hash_block_tokens=16, memory_bytes=64 << 20, disk=tmp_path, disk_bytes=256 << 20)
    assert kvbridge.RankStore(store, writer, wmem).put(tokens, q).objects_published == 4
    assert store.stats()["disk_writes"] == 4 and store.stats()["disk_configured"]
    with pytest.raises(kvbridge.Unavailable, match="in use by another store"):
        kvbridge.Store(disk=str(tmp_path))
    del store
    import gc
    gc.collect()
    later = kvbridge.Store(hash_block_tokens=16, memory_bytes=64 << 20, disk=str(tmp_path))
    rmem = [np.zeros(t.bytes, dtype=np.uint8) for t in writer.tensors]
    rq = kvbridge.Request(64, {"full": ([7, 6, 2, 0], [])})
    got = kvbridge.RankStore(later, writer, rmem).get(tokens, rq)
    assert got.hit_tokens == 64 and got.disk_objects == 4 and got.memory_objects == 0
    report = kvbridge.check_request(writer, rq, rmem, side="local", seed=9)
    assert report.bad_cells == 0 and report.cells > 0, report.first_error
    assert later.stats()["disk_hits"] == 4


def test_one_shared_tier_only():
    with pytest.raises(kvbridge.InvalidArgument, match="give one shared tier"):
        kvbridge.Store(redis="127.0.0.1:6379", redis_cluster="127.0.0.1:7000")
    s = kvbridge.Store(redis_cluster="127.0.0.1:1")  # contacted by the first operation only
    assert s.stats()["redis_configured"] and s.stats()["redis_nodes"] == 0

"""The reference engine (examples/mini_engine): real transformers served P/D through
kvbridge.connector_v1, one process per TP rank. Their tokens and logits must equal a
colocated run's bit for bit: the arithmetic does not depend on TP or block size, so any
difference is a transfer defect."""
import os
import sys

import pytest
import torch

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES / "mini_engine"))
import engine  # noqa: E402
from model import ModelConfig  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 40, 5


def run(kind, ptp, dtp, pblock, dblock, porder="layer", dorder="layer", chunk=0, fault="none", policy="fail"):
    cfg = ModelConfig(kind=kind)
    prompt = torch.randint(0, cfg.vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = engine.colocated(cfg, prompt, NEW_TOKENS)
    blocks = lambda bs: 2 * (-(-(PROMPT_TOKENS + NEW_TOKENS) // bs)) + 2  # noqa: E731
    p = engine.InstanceSpec("prefill", ptp, pblock, blocks(pblock), porder, chunk=chunk)
    d = engine.InstanceSpec("decode", dtp, dblock, blocks(dblock), dorder, policy=policy)
    got = engine.run_pd(cfg, p, d, prompt, NEW_TOKENS, fault=fault)
    return ref, got


# Every model at every TP pair of {1, 2, 4} x {1, 2, 4}; the block sizes (16 -> 32, 64 -> 16),
# the cache orders (per-layer tensors, one block-major tensor) and chunked prefill rotate
# over the pairs, so each model meets each of them.
GEOMETRIES = [(16, 32, "layer", "block", 0), (64, 16, "block", "layer", 16), (16, 32, "block", "block", 24),
              (64, 16, "layer", "layer", 0)]
# KVB_ENGINE_MATRIX=full (make engine-matrix): every model, TP pair, block sizes, cache orders
# and chunking, all combined.
PAIRS = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]
if os.environ.get("KVB_ENGINE_MATRIX") == "full":
    CASES = [(kind, ptp, dtp, pb, db, po, do, chunk) for kind in ("llama", "mla", "hybrid") for ptp, dtp in PAIRS
             for pb, db in ((16, 32), (64, 16)) for po, do in (("layer", "block"), ("block", "layer"))
             for chunk in (0, 16)]
else:
    CASES = [(kind, ptp, dtp) + GEOMETRIES[(i + k) % len(GEOMETRIES)]
             for k, kind in enumerate(("llama", "mla", "hybrid")) for i, (ptp, dtp) in enumerate(PAIRS)]


@pytest.mark.parametrize("kind,ptp,dtp,pblock,dblock,porder,dorder,chunk", CASES,
                         ids=[f"{c[0]}-tp{c[1]}to{c[2]}-b{c[3]}to{c[4]}-{c[5]}to{c[6]}" + ("-chunked" if c[7] else "")
                              for c in CASES])
def test_pd_output_equals_colocated_bit_for_bit(kind, ptp, dtp, pblock, dblock, porder, dorder, chunk):
    ref, got = run(kind, ptp, dtp, pblock, dblock, porder, dorder, chunk)
    assert got.failed is None, got.failed
    assert engine.compare(ref, got) is None, engine.compare(ref, got)
    assert got.prefill_freed, "the prefill never freed the request's blocks"
    assert got.held == {"decode": 0, "prefill": 0}, got.held


FAULT_CASES = [
    # fault, policy, model, what the run must show beyond engine.expected()
    ("kill-prefill", "recompute", "hybrid", "recomputed"),
    ("kill-prefill", "fail", "llama", "unavailable"),
    ("stall", "recompute", "mla", "recomputed"),
    ("stall", "fail", "llama", "timeout"),
    ("drop-done", "fail", "llama", ""),       # prefill frees at lease expiry
    ("kill-decode", "fail", "llama", ""),     # prefill frees at lease expiry
    ("wrong-secret", "fail", "llama", "permission_denied"),
    ("incompatible", "fail", "llama", "incompatible"),
    ("abort", "fail", "hybrid", "cancelled"),
]


@pytest.mark.parametrize("fault,policy,kind,shows", FAULT_CASES, ids=[f"{c[0]}-{c[1]}" for c in FAULT_CASES])
def test_every_fault_ends_identical_or_with_a_clear_error_and_no_block_held(fault, policy, kind, shows):
    cfg = ModelConfig(kind=kind)
    prompt = torch.randint(0, cfg.vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = engine.colocated(cfg, prompt, NEW_TOKENS)
    p, d = engine.with_fault(engine.InstanceSpec("prefill", 2, 16, 12), engine.InstanceSpec("decode", 2, 32, 6,
                                                                                            policy=policy), fault)
    got = engine.run_pd(cfg, p, d, prompt, NEW_TOKENS, fault=fault)
    diff = None if got.failed else engine.compare(ref, got)
    assert engine.expected(fault, policy, got, diff, got.held), (got.failed, diff, got.held, got.prefill_freed)
    if shows == "recomputed":
        assert got.recomputed_tokens == PROMPT_TOKENS
    elif shows:
        assert got.failed[1] == shows, got.failed
    if fault in ("wrong-secret", "incompatible"):  # the error names what is wrong
        assert ("secret" if fault == "wrong-secret" else "model differs") in got.failed[2], got.failed


def test_the_check_sees_one_changed_value_of_the_loaded_kv():
    ref, got = run("llama", 1, 2, 16, 32, fault="corrupt-kv")
    assert got.failed is None
    assert engine.compare(ref, got) is not None


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_a_prefix_store_hit_serves_the_first_part_and_prefill_the_rest(kind, redis_address):
    cfg = ModelConfig(kind=kind)
    g = torch.Generator().manual_seed(11)
    first = torch.randint(0, cfg.vocab, (48,), generator=g).tolist()
    second = first[:32] + torch.randint(0, cfg.vocab, (16,), generator=g).tolist()  # shares 32 tokens
    p = engine.InstanceSpec("prefill", 2, 16, 16, store_redis=redis_address)
    d = engine.InstanceSpec("decode", 4, 32, 8, "block", store_redis=redis_address)
    cluster = engine.Cluster(cfg, p, d)
    try:
        engine.run_pd(cfg, p, d, first, NEW_TOKENS, cluster=cluster, rid="req-0")  # stores its prompt
        got = engine.run_pd(cfg, p, d, second, NEW_TOKENS, cluster=cluster, rid="req-1")
    finally:
        held = cluster.close()
    # Prefill computed only the 16 new tokens; decode read the 32 stored ones from the store
    # (TP 2 wrote them, TP 4 read them) and only the rest from prefill.
    assert got.prefill_store_tokens == 32 and got.decode_store_tokens == 32, got
    ref = engine.colocated(cfg, second, NEW_TOKENS)
    assert engine.compare(ref, got) is None, engine.compare(ref, got)
    assert held == {"decode": 0, "prefill": 0}, held


@pytest.mark.parametrize("kind,chunk", [("llama", 0), ("hybrid", 16)])
def test_a_streamed_load_read_while_prefill_computes_gives_the_same_output(kind, chunk):
    cfg = ModelConfig(kind=kind)
    prompt = torch.randint(0, cfg.vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    p = engine.InstanceSpec("prefill", 2, 16, 12, chunk=chunk)
    d = engine.InstanceSpec("decode", 4, 32, 6, "block")
    cluster = engine.Cluster(cfg, p, d)
    try:
        got = engine.run_pd(cfg, p, d, prompt, NEW_TOKENS, cluster=cluster, stream=True)
    finally:
        held = cluster.close()
    assert got.failed is None, got.failed
    assert engine.compare(engine.colocated(cfg, prompt, NEW_TOKENS), got) is None
    assert got.prefill_freed and held == {"decode": 0, "prefill": 0}, held

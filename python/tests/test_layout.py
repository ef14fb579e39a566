"""Layouts: JSON, presets, identity and compatibility, and layouts built from
an engine's own torch tensors / numpy arrays."""
import pickle

import numpy as np
import pytest
import torch

import kvbridge
from conftest import BLOCK_SIZE, HEAD_SIZE, HEADS, NUM_BLOCKS, torch_caches, torch_spec


def test_presets_build_valid_layouts():
    names = kvbridge.preset_names()
    assert "llama3-8b" in names and "deepseek-v3" in names
    for name in names:
        layout = kvbridge.make_preset(name, num_blocks=4)
        layout.validate()
        assert kvbridge.preset_summary(name)
    assert kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=1, order="BLHNC").tp_rank == 1


def test_preset_option_errors_name_the_option():
    with pytest.raises(kvbridge.InvalidArgument):
        kvbridge.make_preset("llama3-8b", order="XYZ")


def test_json_round_trip_save_load_dict_and_pickle(tmp_path, small_layout):
    text = small_layout.to_json()
    assert kvbridge.Layout.from_json(text) == small_layout
    assert kvbridge.Layout.from_json(small_layout.to_json(indent=-1)) == small_layout
    path = tmp_path / "l.json"
    small_layout.save(str(path))
    assert kvbridge.Layout.load(str(path)) == small_layout
    d = small_layout.to_dict()
    assert d["format"] == "kvbridge.layout/1" and d["model"] == "llama3-8b"
    assert kvbridge.Layout.from_dict(d) == small_layout
    assert pickle.loads(pickle.dumps(small_layout)) == small_layout


def test_model_classes_read_like_the_json(small_layout):
    g = small_layout.groups[0]
    assert g.kind == "attention" and g.num_blocks == 8
    c = g.layers[0].components[0]
    assert c.name == "k" and c.heads.total == 8
    assert {a.kind for a in c.axes} == {"block", "head", "position"}
    assert small_layout.find_group("full").name == "full"
    assert small_layout.find_group("nope") is None
    assert small_layout.find_tensor(small_layout.tensor_names[0]).bytes == small_layout.tensors[0].bytes


def test_identity_ignores_tp_and_blocks_but_not_cell_bytes():
    a = kvbridge.make_preset("llama3-8b", tp_size=1, num_blocks=8)
    b = kvbridge.make_preset("llama3-8b", tp_size=2, tp_rank=1, num_blocks=16, block_tokens=32, order="LBNHC")
    assert a.compatibility_hash == b.compatibility_hash
    assert a.identity_text() == b.identity_text()
    assert len(a.compatibility_hash_hex) == 16
    a.check_compatible(b)
    groups = b.groups
    comp = groups[0].layers[0].components[0]
    comp.cell_bytes //= 2
    groups[0].layers[0].components = [comp] + groups[0].layers[0].components[1:]
    b.groups = groups
    with pytest.raises(kvbridge.Incompatible, match=r"group 'full' layer 'layers.0' component 'k': cell_bytes differs"):
        a.check_compatible(b)
    with pytest.raises(kvbridge.Incompatible, match="cell_bytes differs"):
        kvbridge.compare_identity_text(a.identity_text(), b.identity_text())


def test_validate_names_the_component_at_fault(small_layout):
    tensors = small_layout.tensors
    tensors[0].bytes = 1024
    small_layout.tensors = tensors
    with pytest.raises(kvbridge.OutOfRange, match="component 'k'"):
        small_layout.validate()


def test_layout_from_torch_tensors_matches_their_geometry():
    kv = torch_caches()
    layout = kvbridge.layout_from_tensors(torch_spec(kv))
    assert layout.dtype == "bf16" and layout.tensor_names == ["kv.0", "kv.1"]
    g = layout.groups[0]
    assert (g.name, g.kind, g.block_tokens, g.num_blocks) == ("full", "attention", BLOCK_SIZE, NUM_BLOCKS)
    k, v = g.layers[0].components
    assert k.cell_bytes == HEAD_SIZE * 2 and k.offset == 0
    assert v.offset == kv[0][1].data_ptr() - kv[0].data_ptr()
    assert k.heads == kvbridge.HeadMap(total=HEADS, first=0, count=HEADS)
    axes = {a.kind: (a.size, a.stride) for a in k.axes}
    assert axes["block"] == (NUM_BLOCKS, kv[0].stride(1) * 2)
    assert axes["position"] == (BLOCK_SIZE, kv[0].stride(2) * 2)
    assert axes["head"] == (HEADS, kv[0].stride(3) * 2)
    assert layout.tensors[0].bytes == kv[0].numel() * 2


def test_layout_from_tensors_with_tp_heads_and_numpy():
    # Rank 1 of TP 2 holds heads 4..7 of 8; a numpy cache laid out [block][head][position][cell].
    arrays = [np.zeros((2, NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE), np.float16) for _ in range(2)]
    spec = {"model": "toy", "tp_size": 2, "tp_rank": 1, "dims": "block head position cell",
            "tensors": {f"kv.{i}": a for i, a in enumerate(arrays)},
            "groups": [{"name": "full", "layers": [
                {"name": f"layers.{i}", "components": {"k": a[0], "v": a[1]}} for i, a in enumerate(arrays)]}]}
    layout = kvbridge.layout_from_tensors(spec)
    assert layout.dtype == "fp16"
    assert layout.groups[0].layers[1].components[1].heads == kvbridge.HeadMap(8, 4, 4)
    # The same model at TP 1 is compatible, whatever the axis order.
    assert layout.is_compatible(kvbridge.layout_from_tensors(torch_spec(torch_caches(heads=8, dtype=torch.float16))))


def test_layout_from_tensors_refuses_an_ambiguous_head_count():
    # One head per rank at TP 4: 4 heads, or 2 (or 1) replicated? Refused unless told.
    arrays = [np.zeros((2, NUM_BLOCKS, 1, BLOCK_SIZE, HEAD_SIZE), np.float16)]
    spec = {"model": "toy", "tp_size": 4, "tp_rank": 3, "dims": "block head position cell",
            "tensors": {"kv.0": arrays[0]},
            "groups": [{"name": "full", "layers": [{"name": "layers.0",
                                                    "components": {"k": arrays[0][0], "v": arrays[0][1]}}]}]}
    with pytest.raises(kvbridge.InvalidArgument, match=r"holds 1 head at TP 4.*give heads\['total'\]"):
        kvbridge.layout_from_tensors(spec)
    # Told: 2 KV heads at TP 4, rank 3 holds head 1 (ranks 2 and 3 share it).
    spec["heads"] = {"total": 2}
    layout = kvbridge.layout_from_tensors(spec)
    assert layout.groups[0].layers[0].components[0].heads == kvbridge.HeadMap(2, 1, 1)
    spec["heads"] = {"total": 4}
    assert kvbridge.layout_from_tensors(spec).groups[0].layers[0].components[0].heads == kvbridge.HeadMap(4, 3, 1)


def test_layout_from_dicts_describing_tensors():
    base = 0x10000000
    t = {"data_ptr": base, "bytes": 2 * NUM_BLOCKS * BLOCK_SIZE * HEADS * HEAD_SIZE * 2, "memory": "host"}
    half = NUM_BLOCKS * BLOCK_SIZE * HEADS * HEAD_SIZE
    view = lambda off: {"data_ptr": base + off * 2, "shape": (NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE),
                        "strides": (BLOCK_SIZE * HEADS * HEAD_SIZE, HEADS * HEAD_SIZE, HEAD_SIZE, 1),
                        "dtype": "torch.bfloat16"}
    layout = kvbridge.layout_from_tensors({
        "model": "toy", "tensors": {"kv.0": t}, "dims": ["block", "position", "head", "cell"],
        "groups": {"full": {"layers": {"layers.0": {"k": view(0), "v": view(half)}}}}})
    assert layout.groups[0].layers[0].components[1].offset == half * 2


def test_layout_from_tensors_errors_name_the_component():
    kv = torch_caches()
    spec = torch_spec(kv)
    spec["dims"] = "block head position"  # 3 names for 4 dimensions
    with pytest.raises(kvbridge.InvalidArgument, match="group 'full' layer 'layers.0' component 'k'"):
        kvbridge.layout_from_tensors(spec)
    spec = torch_spec(kv)
    spec["groups"]["full"]["layers"]["layers.0"]["k"] = kv[0][0].transpose(-1, -2)
    with pytest.raises(kvbridge.InvalidArgument, match="not contiguous"):
        kvbridge.layout_from_tensors(spec)
    spec = torch_spec(kv)
    spec["groups"]["full"]["layers"]["layers.0"]["k"] = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    with pytest.raises(kvbridge.InvalidArgument, match="lies in none of the tensors"):
        kvbridge.layout_from_tensors(spec)


def test_request_round_trip():
    r = kvbridge.Request(40, {"full": ([0, 1, 2], [5, 6, 7])}, skip_tokens=16)
    assert r.blocks["full"] == kvbridge.GroupBlocks([0, 1, 2], [5, 6, 7])
    assert kvbridge.Request.from_json(r.to_json()) == r
    assert pickle.loads(pickle.dumps(r)) == r
    r2 = kvbridge.Request(40, {"full": {"local": [0], "remote": [1]}})
    assert r2.blocks["full"].remote == [1]

"""Build a kvbridge Layout from an engine's own tensors.

A serving engine already knows its KV caches as torch tensors (or numpy
arrays): allocations, and per layer and component a strided view into one of
them, e.g. vLLM's per-layer ``kv[2, num_blocks, block_size, num_heads,
head_size]`` whose ``kv[0]`` is K and ``kv[1]`` is V. ``layout_from_tensors``
turns that description into a validated ``kvbridge.layout`` Layout: it reads
each view's ``data_ptr``, shape, strides and dtype, and needs only to be told
what each dimension means (``"block"``, ``"head"``, ``"position"`` or
``"cell"``).

Anything with ``data_ptr()``/``shape``/``stride()``/``element_size()`` (torch),
with ``__array_interface__`` (numpy), or a dict ``{"data_ptr", "shape",
"strides", "dtype"}`` (strides in elements, as torch counts them) describes a
view; a dict ``{"data_ptr", "bytes", "memory"}`` describes an allocation.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _kvbridge

# Layout dtype names for torch / numpy element types.
_DTYPE_NAMES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
}
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8": 1,
                "int8": 1, "uint8": 1, "int16": 2, "int32": 4}
_DIMS = ("block", "head", "position", "cell")


def _fail(where: str, what: str) -> "_kvbridge.InvalidArgument":
    return _kvbridge.InvalidArgument(f"{where}: {what}" if where else what)


def dtype_name(dtype: Any) -> str:
    """The layout dtype name ("bf16", "fp16", "fp8_e4m3", ...) of a torch or numpy dtype, or a name."""
    s = str(dtype)
    s = s[len("torch."):] if s.startswith("torch.") else s
    return _DTYPE_NAMES.get(s, s)


def _memory_of_device(device: Any) -> str:
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        return "host"
    if kind == "cuda":
        index = getattr(device, "index", None)
        return f"cuda:{0 if index is None else index}"
    raise _kvbridge.InvalidArgument(f"tensors on device '{kind}' are not supported (expected cpu or cuda)")


def describe_tensor(t: Any) -> Dict[str, Any]:
    """A dict describing a torch tensor or numpy array: data_ptr, shape, strides (elements), dtype
    (layout name), element_size, bytes (numel * element_size) and memory ("host" or "cuda:N").
    A dict is returned as given (with element_size and memory filled in when missing)."""
    if isinstance(t, Mapping):
        d = dict(t)
        if "element_size" not in d and "dtype" in d:
            name = dtype_name(d["dtype"])
            if name not in _DTYPE_BYTES:
                raise _kvbridge.InvalidArgument(f"unknown dtype '{d['dtype']}': give element_size")
            d["element_size"] = _DTYPE_BYTES[name]
        d.setdefault("memory", "host")
        return d
    if hasattr(t, "data_ptr") and hasattr(t, "element_size") and hasattr(t, "stride"):
        return {
            "data_ptr": int(t.data_ptr()),
            "shape": tuple(int(x) for x in t.shape),
            "strides": tuple(int(x) for x in t.stride()),
            "dtype": dtype_name(t.dtype),
            "element_size": int(t.element_size()),
            "bytes": int(t.numel()) * int(t.element_size()),
            "memory": _memory_of_device(t.device),
        }
    if hasattr(t, "__array_interface__"):
        itemsize = int(t.itemsize)
        return {
            "data_ptr": int(t.__array_interface__["data"][0]),
            "shape": tuple(int(x) for x in t.shape),
            "strides": tuple(int(s) // itemsize for s in t.strides),
            "dtype": dtype_name(t.dtype),
            "element_size": itemsize,
            "bytes": int(t.nbytes),
            "memory": "host",
        }
    raise _kvbridge.InvalidArgument(
        f"cannot describe a {type(t).__name__}: expected a torch tensor, a numpy array or a dict")


def _dims_of(dims: Union[str, Sequence[str]], where: str) -> List[str]:
    out = dims.replace(",", " ").split() if isinstance(dims, str) else list(dims)
    for d in out:
        if d not in _DIMS:
            raise _fail(where, f"unknown dimension '{d}' (expected one of {', '.join(_DIMS)})")
    return out


def _component(name: str, spec: Any, defaults: Dict[str, Any], tensors: List[Tuple[str, Dict[str, Any]]],
               tp_size: int, tp_rank: int, where: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Returns (the component's JSON dict, its view description)."""
    if isinstance(spec, tuple):
        spec = {"view": spec[0], "dims": spec[1]}
    elif not isinstance(spec, Mapping) or "view" not in spec:
        spec = {"view": spec}
    view = describe_tensor(spec["view"])
    for key in ("data_ptr", "shape", "strides"):
        if key not in view:
            raise _fail(where, f"the view needs '{key}'")
    shape, strides = list(view["shape"]), list(view["strides"])
    if len(shape) != len(strides):
        raise _fail(where, f"shape {shape} and strides {strides} differ in length")
    dims = _dims_of(spec.get("dims", defaults.get("dims", "")), where)
    if len(dims) != len(shape):
        raise _fail(where, f"dims {dims} name {len(dims)} dimensions but the view has {len(shape)} (shape {shape})")
    if dims.count("block") != 1 or dims.count("head") > 1 or dims.count("position") > 4:
        raise _fail(where, f"dims {dims}: need one 'block', at most one 'head' and at most four 'position'")
    # The cell: the trailing "cell" dimensions, contiguous.
    first_cell = len(dims)
    while first_cell > 0 and dims[first_cell - 1] == "cell":
        first_cell -= 1
    if "cell" in dims[:first_cell]:
        raise _fail(where, f"dims {dims}: 'cell' dimensions must come last")
    esize = int(view["element_size"])
    expected = 1
    for i in range(len(dims) - 1, first_cell - 1, -1):
        if shape[i] != 1 and strides[i] != expected:
            raise _fail(where, f"the cell dimensions {shape[first_cell:]} are not contiguous (strides "
                               f"{strides[first_cell:]})")
        expected *= shape[i]
    cell_bytes = esize * math.prod(shape[first_cell:])
    axes = []
    for i in range(first_cell):
        if strides[i] < 0:
            raise _fail(where, f"dimension {i} has a negative stride")
        axes.append({"axis": dims[i], "size": shape[i], "stride": strides[i] * esize})
    # The allocation holding the view.
    ptr = int(view["data_ptr"])
    tensor = spec.get("tensor")
    if tensor is None:
        for tname, t in tensors:
            if t["data_ptr"] <= ptr < t["data_ptr"] + t["bytes"]:
                tensor = tname
                break
        if tensor is None:
            raise _fail(where, f"the view at 0x{ptr:x} lies in none of the tensors given")
    base = dict(tensors).get(tensor)
    if base is None:
        raise _fail(where, f"unknown tensor '{tensor}'")
    if ptr < base["data_ptr"]:
        raise _fail(where, f"the view starts before tensor '{tensor}'")
    comp: Dict[str, Any] = {"name": name, "tensor": tensor, "offset": ptr - base["data_ptr"],
                            "cell_bytes": cell_bytes, "axes": axes}
    heads = spec.get("heads", defaults.get("heads"))
    if "head" in dims:
        count = shape[dims.index("head")]
        heads = dict(heads or {})
        if "total" not in heads and count == 1 and tp_size > 1:
            # One head per rank at TP > 1: a model of tp_size heads, or one of
            # fewer heads that TP replicates (2 KV heads at TP 4). Not guessed.
            fewer = [t for t in range(tp_size - 1, 0, -1) if tp_size % t == 0]
            raise _fail(where, f"heads: this rank holds 1 head at TP {tp_size}, which fits a model of {tp_size} "
                               f"heads (one per rank) or of {', '.join(map(str, fewer))} replicated over the ranks: "
                               f"give heads['total']")
        total = int(heads.get("total", count * tp_size))
        # TP above the heads: each head is held by tp_size / total consecutive ranks.
        default_first = tp_rank * count if tp_size <= total else tp_rank // max(tp_size // total, 1)
        first = int(heads.get("first", default_first))
        if first + count > total:
            raise _fail(where, f"heads: first {first} + count {count} exceeds total {total}: give heads['first']")
        comp["heads"] = {"total": total, "first": first, "count": count}
    elif heads is not None:
        comp["heads"] = {"total": int(heads["total"]), "first": int(heads.get("first", 0)), "count": 1}
    return comp, view


def _items(x: Any) -> List[Tuple[str, Any]]:
    """(name, value) pairs from a dict, or from a list of dicts with a "name"."""
    if isinstance(x, Mapping):
        return list(x.items())
    out = []
    for v in x:
        if isinstance(v, Mapping) and "name" in v:
            out.append((v["name"], v))
        else:
            out.append(tuple(v))
    return out


def layout_dict_from_tensors(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """The `kvbridge.layout/1` dict that layout_from_tensors() validates; see there."""
    tp_size = int(spec.get("tp_size", 1))
    tp_rank = int(spec.get("tp_rank", 0))
    tensors: List[Tuple[str, Dict[str, Any]]] = []
    for tname, t in _items(spec["tensors"]):
        d = describe_tensor(t)
        if "bytes" not in d:
            raise _fail(f"tensor '{tname}'", "needs 'bytes'")
        tensors.append((str(tname), d))
    top_defaults = {k: spec[k] for k in ("dims", "heads") if k in spec}
    dtype = spec.get("dtype")
    groups = []
    for gname, g in _items(spec["groups"]):
        gwhere = f"group '{gname}'"
        defaults = dict(top_defaults)
        defaults.update({k: g[k] for k in ("dims", "heads") if k in g})
        layers = []
        num_blocks: Optional[int] = g.get("num_blocks")
        positions: Optional[int] = None
        for lname, layer in _items(g["layers"]):
            comps_spec = layer["components"] if isinstance(layer, Mapping) and "components" in layer else layer
            comps = []
            for cname, cspec in _items(comps_spec):
                where = f"{gwhere} layer '{lname}' component '{cname}'"
                comp, view = _component(cname, cspec, defaults, tensors, tp_size, tp_rank, where)
                if dtype is None and "dtype" in view:
                    dtype = view["dtype"]
                for a in comp["axes"]:
                    if a["axis"] == "block":
                        if num_blocks is None:
                            num_blocks = a["size"]
                        elif a["size"] != num_blocks:
                            raise _fail(where, f"has {a['size']} blocks, the group {num_blocks}")
                p = math.prod(a["size"] for a in comp["axes"] if a["axis"] == "position")
                positions = p if positions is None else positions
                comps.append(comp)
            layers.append({"name": lname, "components": comps})
        kind = g.get("kind", "attention")
        tps = int(g.get("tokens_per_state", 1))
        block_tokens = g.get("block_tokens")
        if block_tokens is None:
            if kind == "state":
                raise _fail(gwhere, "a state group needs block_tokens")
            block_tokens = (positions or 1) * tps
        groups.append({
            "name": gname, "kind": kind, "block_tokens": int(block_tokens), "tokens_per_state": tps,
            "window_tokens": g.get("window_tokens"), "prefix_cacheable": bool(g.get("prefix_cacheable", kind != "scratch")),
            "transfer": bool(g.get("transfer", True)), "num_blocks": int(num_blocks or 0), "layers": layers,
        })
    if dtype is None:
        raise _fail("", "no dtype given and no view to take it from")
    return {
        "format": "kvbridge.layout/1", "model": spec["model"], "dtype": dtype_name(dtype),
        "tp_size": tp_size, "tp_rank": tp_rank,
        "tensors": [{"name": n, "bytes": int(t["bytes"]), "memory": t.get("memory", "host")} for n, t in tensors],
        "groups": groups,
    }


def layout_from_tensors(spec: Mapping[str, Any]) -> "_kvbridge.Layout":
    """Builds and validates a Layout from a dict describing an engine's tensors.

    spec keys:
      model (required), dtype (default: the first view's), tp_size (1), tp_rank (0);
      tensors: {name: allocation}: a torch tensor, numpy array or {"data_ptr", "bytes", "memory"};
               the order is the layout's tensor order (the order memory is later passed in);
      dims, heads: defaults for every component (a group may override them);
      groups: {name: group} or a list of groups with "name". A group has
        kind ("attention"), block_tokens (default: positions per block x tokens_per_state),
        tokens_per_state (1), window_tokens, prefix_cacheable, transfer, num_blocks (default:
        the block dimension's size), dims, heads, and
        layers: {layer name: {component name: component}} (or lists of dicts with "name").
    A component is a view (torch tensor, numpy array, or {"data_ptr", "shape", "strides",
    "dtype"} with strides in elements), a (view, dims) tuple, or a dict {"view", "dims",
    "tensor", "heads"}. dims names each dimension of the view, outermost first: "block"
    (once), "head" (at most once), "position" (up to four, outermost first) and trailing
    contiguous "cell" dimensions, e.g. "block position head cell" for vLLM's
    [num_blocks, block_size, num_heads, head_size]. The tensor holding a view is found from
    its data_ptr unless named. heads: {"total", "first"} (default: count x tp_size heads, this
    rank holding the tp_rank-th slice; with one head per rank at TP > 1, total must be given,
    since fewer heads replicated over the ranks look the same, and first then defaults to
    tp_rank / (tp_size / total)); a component without a head dimension is replicated unless
    heads is given.

    Raises InvalidArgument naming the group, layer and component at fault, or the layout
    validator's error (validate()).
    """
    return _kvbridge.Layout.from_dict(layout_dict_from_tensors(spec))

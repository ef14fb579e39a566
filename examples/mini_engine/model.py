"""The mini engine's models: small transformers with random weights from a fixed seed.

Tensor parallelism here shapes memory, not arithmetic: every rank computes the full
projections and keeps only its heads' KV; attention runs per head on the rank that holds
it; the heads' outputs are gathered (concatenated, never summed) before the output
projection. Every token is computed on its own (one query row against exactly the keys
before it, one vector-matrix product per projection), so a token's result does not depend
on the TP size, the block size, the chunking of the prompt or where its KV came from: any
difference between two runs is a KV transfer bug.

Models:
  llama: GQA attention with RoPE (q heads in groups over the KV heads), RMSNorm, SwiGLU.
  mla:   one compressed latent plus a shared RoPE key per token and layer, replicated on
         every rank (DeepSeek-style MLA); each rank attends with its query heads.
  hybrid: linear-attention layers (a recurrent state per request and head, sharded over the
         ranks by head, fed by a short causal convolution over a ring buffer of the last
         ring_tokens inputs, replicated), with full GQA attention every 4th layer.

Block tables are per group: "full" (the attention KV, one block per block_size tokens),
and for the hybrid "state" and "ring" (one block per request each).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

MODELS = ("llama", "mla", "hybrid")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    kind: str = "llama"
    vocab: int = 97
    hidden: int = 64
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 4       # llama
    head_dim: int = 16
    latent: int = 32        # mla: the compressed KV latent
    rope_dim: int = 8       # mla: the shared RoPE key
    ffn: int = 96
    state_heads: int = 4    # hybrid: linear-attention heads (state [head_dim, head_dim] each)
    ring_tokens: int = 4    # hybrid: the convolution's window, kept in a ring buffer
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.kind not in MODELS:
            raise ValueError(f"model '{self.kind}' (expected one of {', '.join(MODELS)})")

    @property
    def name(self) -> str:
        return f"mini-{self.kind}"

    def attention_layer(self, i: int) -> bool:
        return self.kind != "hybrid" or i % 4 == 3


def _weights(cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    out = {"embed": torch.randn(cfg.vocab, cfg.hidden, generator=g), "lm_head": w(cfg.hidden, cfg.vocab),
           "final_norm": 1 + 0.1 * torch.randn(cfg.hidden, generator=g)}
    for i in range(cfg.layers):
        p = f"l{i}."
        out[p + "norm1"] = 1 + 0.1 * torch.randn(cfg.hidden, generator=g)
        out[p + "norm2"] = 1 + 0.1 * torch.randn(cfg.hidden, generator=g)
        out[p + "wq"] = w(cfg.hidden, cfg.q_heads * cfg.head_dim)
        out[p + "wo"] = w(cfg.q_heads * cfg.head_dim, cfg.hidden)
        out[p + "w_gate"] = w(cfg.hidden, cfg.ffn)
        out[p + "w_up"] = w(cfg.hidden, cfg.ffn)
        out[p + "w_down"] = w(cfg.ffn, cfg.hidden)
        if cfg.kind == "hybrid" and not cfg.attention_layer(i):
            out[p + "conv"] = torch.randn(cfg.ring_tokens, cfg.hidden, generator=g) / cfg.ring_tokens
            out[p + "wq"] = w(cfg.hidden, cfg.state_heads * cfg.head_dim)
            out[p + "wk_lin"] = w(cfg.hidden, cfg.state_heads * cfg.head_dim)
            out[p + "wv_lin"] = w(cfg.hidden, cfg.state_heads * cfg.head_dim)
            out[p + "wo"] = w(cfg.state_heads * cfg.head_dim, cfg.hidden)
            out[p + "decay"] = torch.sigmoid(2 + torch.randn(cfg.state_heads, generator=g))
        elif cfg.kind in ("llama", "hybrid"):
            out[p + "wk"] = w(cfg.hidden, cfg.kv_heads * cfg.head_dim)
            out[p + "wv"] = w(cfg.hidden, cfg.kv_heads * cfg.head_dim)
        else:
            out[p + "w_latent"] = w(cfg.hidden, cfg.latent)
            out[p + "w_krope"] = w(cfg.hidden, cfg.rope_dim)
            out[p + "wq_rope"] = w(cfg.hidden, cfg.q_heads * cfg.rope_dim)
            out[p + "w_uk"] = w(cfg.latent, cfg.q_heads * cfg.head_dim)
            out[p + "w_uv"] = w(cfg.latent, cfg.q_heads * cfg.head_dim)
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean() + 1e-6) * weight


def _rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """RoPE on the last dimension of x ([..., d], d even) at position pos."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos * inv
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


Gather = Callable[[torch.Tensor], torch.Tensor]  # this rank's head outputs -> every rank's, in rank order


class RankModel:
    """One TP rank of a model: the weights (every rank has them all), this rank's paged KV
    cache (its heads only, or the replicated latent for MLA), and the forward pass of one
    token at a time."""

    def __init__(self, cfg: ModelConfig, tp: int, rank: int, block_size: int, num_blocks: int,
                 order: str = "layer", request_blocks: int = 8) -> None:
        if cfg.q_heads % tp or (cfg.kind != "mla" and cfg.kv_heads % tp) or (cfg.kind == "hybrid" and cfg.state_heads % tp):
            raise ValueError(f"TP {tp} does not divide the heads of {cfg.name}")
        if order not in ("layer", "block"):
            raise ValueError(f"order '{order}' (expected layer or block)")
        self.cfg, self.tp, self.rank = cfg, tp, rank
        self.block_size, self.num_blocks, self.order = block_size, num_blocks, order
        self.w = _weights(cfg)
        self.q_local = cfg.q_heads // tp
        self.kv_local = cfg.kv_heads // tp
        self.state_local = cfg.state_heads // tp
        self.request_blocks = request_blocks  # the pools of the one-block-per-request groups
        self.caches: Dict[str, torch.Tensor] = {}
        # Per layer: K and V ([blocks, block_size, heads, head_dim]), the MLA latent, or the
        # linear-attention state and ring.
        nb, bs, L = num_blocks, block_size, cfg.layers
        attn = [i for i in range(L) if cfg.attention_layer(i)]
        self.views: List[Dict[str, torch.Tensor]] = [{} for _ in range(L)]
        if cfg.kind in ("llama", "hybrid"):
            if order == "layer":  # vLLM's per-layer [2, blocks, block_size, heads, head_dim]
                for i in attn:
                    t = torch.zeros(2, nb, bs, self.kv_local, cfg.head_dim)
                    self.caches[f"layers.{i}"] = t
                    self.views[i] = {"k": t[0], "v": t[1]}
            else:  # block-major: one allocation [blocks, layers, 2, block_size, heads, head_dim]
                t = torch.zeros(nb, len(attn), 2, bs, self.kv_local, cfg.head_dim)
                self.caches["kv"] = t
                for j, i in enumerate(attn):
                    self.views[i] = {"k": t[:, j, 0], "v": t[:, j, 1]}
        if cfg.kind == "hybrid":
            lin = [i for i in range(L) if not cfg.attention_layer(i)]
            rb, d = request_blocks, cfg.head_dim
            state = torch.zeros(rb, len(lin), self.state_local, d, d)
            ring = torch.zeros(rb, len(lin), cfg.ring_tokens, cfg.hidden)
            self.caches["state"], self.caches["ring"] = state, ring
            for j, i in enumerate(lin):
                self.views[i] = {"state": state[:, j], "ring": ring[:, j]}
        if cfg.kind == "mla":  # one [blocks, block_size, latent + rope] per layer, or block-major
            width = cfg.latent + cfg.rope_dim
            if order == "layer":
                for i in range(L):
                    t = torch.zeros(nb, bs, width)
                    self.caches[f"layers.{i}"] = t
                    self.views[i] = {"c": t}
            else:
                t = torch.zeros(nb, L, bs, width)
                self.caches["kv"] = t
                self.views = [{"c": t[:, i]} for i in range(L)]

    def blocks_for(self, tokens: int) -> Dict[str, int]:
        """Blocks a request of `tokens` tokens needs, per group."""
        out = {"full": -(-tokens // self.block_size)}
        if self.cfg.kind == "hybrid":
            out.update(state=1, ring=1)
        return out

    def pool_sizes(self) -> Dict[str, int]:
        out = {"full": self.num_blocks}
        if self.cfg.kind == "hybrid":
            out.update(state=self.request_blocks, ring=self.request_blocks)
        return out

    # -- the layout kvbridge moves

    def layout_spec(self) -> Dict[str, object]:
        """The layout_from_tensors() spec of this rank's cache."""
        cfg = self.cfg
        layers: Dict[str, object] = {}
        states: Dict[str, object] = {}
        rings: Dict[str, object] = {}
        for i, v in enumerate(self.views):
            if "k" in v:
                layers[f"layers.{i}"] = {"k": v["k"], "v": v["v"]}
            elif "c" in v:
                layers[f"layers.{i}"] = {"c": (v["c"], "block position cell")}
            else:
                states[f"layers.{i}"] = {"s": (v["state"], "block head cell cell")}
                rings[f"layers.{i}"] = {"x": (v["ring"], "block position cell")}
        groups: Dict[str, object] = {"full": {"layers": layers}}
        if cfg.kind != "mla":
            groups["full"]["heads"] = {"total": cfg.kv_heads}
        if cfg.kind == "hybrid":
            groups["state"] = {"kind": "state", "block_tokens": 1 << 16, "heads": {"total": cfg.state_heads},
                               "layers": states}
            groups["ring"] = {"kind": "scratch", "block_tokens": cfg.ring_tokens, "prefix_cacheable": False,
                              "layers": rings}
        return {"model": cfg.name, "tp_size": self.tp, "tp_rank": self.rank, "tensors": dict(self.caches),
                "dims": "block position head cell", "groups": groups}

    # -- the forward pass

    def forward(self, tokens: Sequence[int], start: int, block_table: Dict[str, Sequence[int]], gather: Gather,
                on_layer_done: Optional[Callable[[int], None]] = None) -> List[torch.Tensor]:
        """Computes tokens at positions start, start+1, ... (their KV written into the blocks
        of block_table) and returns each one's logits. on_layer_done(layer) runs once a layer
        holds the KV of every token given."""
        h = [self.w["embed"][t].clone() for t in tokens]
        for i in range(self.cfg.layers):
            for j in range(len(tokens)):
                h[j] = self._layer(i, h[j], start + j, block_table, gather)
            if on_layer_done is not None:
                on_layer_done(i)
        return [torch.mv(self.w["lm_head"].t(), _rms(x, self.w["final_norm"])) for x in h]

    def _slot(self, pos: int, block_table: Sequence[int]):
        return block_table[pos // self.block_size], pos % self.block_size

    def _positions(self, end: int, block_table: Sequence[int]):
        pos = torch.arange(end)
        table = torch.tensor(list(block_table), dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size

    def _layer(self, i: int, x: torch.Tensor, pos: int, tables: Dict[str, Sequence[int]], gather: Gather) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"l{i}."
        a = _rms(x, w[p + "norm1"])
        d = cfg.head_dim
        if not cfg.attention_layer(i):
            return self._mlp(i, x + torch.mv(w[p + "wo"].t(), self._linear(i, a, pos, tables, gather)))
        block_table = tables["full"]
        q = torch.mv(w[p + "wq"].t(), a).view(cfg.q_heads, d)
        blocks, slots = self._positions(pos + 1, block_table)
        b, s = self._slot(pos, block_table)
        outs = []
        first_q = self.rank * self.q_local
        if cfg.kind != "mla":
            k = _rope(torch.mv(w[p + "wk"].t(), a).view(cfg.kv_heads, d), pos)
            v = torch.mv(w[p + "wv"].t(), a).view(cfg.kv_heads, d)
            first_kv = self.rank * self.kv_local
            view = self.views[i]
            view["k"][b, s] = k[first_kv:first_kv + self.kv_local]
            view["v"][b, s] = v[first_kv:first_kv + self.kv_local]
            q = _rope(q, pos)
            group = cfg.q_heads // cfg.kv_heads
            for hq in range(first_q, first_q + self.q_local):
                local_kv = hq // group - first_kv
                keys = view["k"][blocks, slots, local_kv]      # [pos + 1, d]
                vals = view["v"][blocks, slots, local_kv]
                prob = torch.softmax(torch.mv(keys, q[hq]) / math.sqrt(d), dim=0)
                outs.append(torch.mv(vals.t(), prob))
        else:
            latent = torch.mv(w[p + "w_latent"].t(), a)
            krope = _rope(torch.mv(w[p + "w_krope"].t(), a), pos)
            self.views[i]["c"][b, s] = torch.cat([latent, krope])
            cache = self.views[i]["c"][blocks, slots]          # [pos + 1, latent + rope]
            c, kr = cache[:, :cfg.latent], cache[:, cfg.latent:]
            q_rope = _rope(torch.mv(w[p + "wq_rope"].t(), a).view(cfg.q_heads, cfg.rope_dim), pos)
            uk = w[p + "w_uk"].view(cfg.latent, cfg.q_heads, d)
            uv = w[p + "w_uv"].view(cfg.latent, cfg.q_heads, d)
            scale = 1.0 / math.sqrt(d + cfg.rope_dim)
            for hq in range(first_q, first_q + self.q_local):
                keys = torch.mm(c, uk[:, hq])                  # [pos + 1, d]
                vals = torch.mm(c, uv[:, hq])
                score = torch.mv(keys, q[hq]) + torch.mv(kr, q_rope[hq])
                prob = torch.softmax(score * scale, dim=0)
                outs.append(torch.mv(vals.t(), prob))
        mine = torch.cat(outs)
        every = gather(mine) if self.tp > 1 else mine
        return self._mlp(i, x + torch.mv(w[p + "wo"].t(), every))

    def _linear(self, i: int, a: torch.Tensor, pos: int, tables: Dict[str, Sequence[int]], gather: Gather) -> torch.Tensor:
        """A linear-attention layer: a causal convolution over the ring of the last inputs, then
        each of this rank's heads updates its state and reads it; the heads' outputs gathered."""
        cfg, w, p, d = self.cfg, self.w, f"l{i}.", self.cfg.head_dim
        ring = self.views[i]["ring"][tables["ring"][-1]]     # [ring_tokens, hidden]
        state = self.views[i]["state"][tables["state"][-1]]  # [heads, d, d]
        if pos == 0:  # a new request: its blocks may hold an earlier request's values
            ring.zero_()
            state.zero_()
        R = cfg.ring_tokens
        ring[pos % R] = a
        conv = torch.zeros(cfg.hidden)
        for age in range(R):
            conv = conv + w[p + "conv"][age] * ring[(pos - age) % R]
        u = torch.nn.functional.silu(conv)
        q = torch.mv(w[p + "wq"].t(), u).view(cfg.state_heads, d)
        k = torch.mv(w[p + "wk_lin"].t(), u).view(cfg.state_heads, d) / math.sqrt(d)
        v = torch.mv(w[p + "wv_lin"].t(), u).view(cfg.state_heads, d)
        outs = []
        first = self.rank * self.state_local
        for h in range(first, first + self.state_local):
            s = state[h - first] * w[p + "decay"][h] + torch.outer(k[h], v[h])
            state[h - first] = s
            outs.append(torch.mv(s.t(), q[h]))
        mine = torch.cat(outs)
        return gather(mine) if self.tp > 1 else mine

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, f"l{i}."
        m = _rms(x, w[p + "norm2"])
        gate = torch.mv(w[p + "w_gate"].t(), m)
        up = torch.mv(w[p + "w_up"].t(), m)
        return x + torch.mv(w[p + "w_down"].t(), torch.nn.functional.silu(gate) * up)

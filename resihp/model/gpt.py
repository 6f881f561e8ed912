"""GPT-style decoder over packed variable-length sequences.

A micro-batch is one packed row of ``T`` tokens holding several documents; ``seq_lens`` gives their
lengths. Attention is causal *within* each document only (document masking), computed the way
``GPTConfig.attention`` says (``resihp.model.attention``).

Parameter names use the global layer index (``layers.7.qkv.weight``) whatever the pipeline layout,
so state can move between layouts by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from resihp.errors import InputError
from resihp.model.attention import PackedDocs, packed_attention
from resihp.model.config import GPTConfig
from resihp.model.shards import chunk_rows
from resihp.model.tensor_parallel import TPContext, copy_to_tp, gather_from_tp, reduce_from_tp

# the AdamW state that travels with each parameter when layers move or checkpoints reshard
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def ensure_adam_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """AdamW state for every parameter (zeros where it has not stepped yet), to save or load
    into."""
    for p in model.parameters():
        state = optimizer.state.setdefault(p, {})
        for k in ADAM_KEYS:
            if state.get(k) is None:
                state[k] = torch.zeros((), device=p.device) if k == "step" else torch.zeros_like(p)


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer: attention and an MLP, each after a LayerNorm.

    Packed causal self-attention (a fused QKV projection), then a GELU MLP or SwiGLU MLP (a fused
    gate/up projection)."""

    def __init__(self, cfg: GPTConfig, tp: TPContext | None = None) -> None:
        super().__init__()
        self.tp = tp or TPContext(1, 0)
        size = self.tp.size
        self.heads, self.head_dim = cfg.heads // size, cfg.hidden // cfg.heads
        local = self.heads * self.head_dim
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * local)  # column parallel (whole heads)
        self.proj = nn.Linear(local, cfg.hidden)  # row parallel
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.attention = cfg.attention
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:  # column parallel per half: [gate shard; up shard]
            self.gate_up = nn.Linear(cfg.hidden, 2 * (cfg.ffn_hidden // size))
        else:
            self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden // size)  # column parallel
        self.fc2 = nn.Linear(cfg.ffn_hidden // size, cfg.hidden)  # row parallel

    def _row(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return layer(x)
        # the bias is added once, after the partial products are summed
        return reduce_from_tp(F.linear(x, layer.weight), self.tp) + layer.bias

    def forward(self, x: torch.Tensor, seq_lens: Sequence[int] | PackedDocs) -> torch.Tensor:
        """Hidden states [T, hidden] of one packed row (``PackedDocs`` to share its masks)."""
        tokens = x.shape[0]
        docs = PackedDocs.of(seq_lens, x.device)
        h = copy_to_tp(self.ln1(x), self.tp)
        q, k, v = self.qkv(h).view(tokens, 3, self.heads, self.head_dim).unbind(1)
        attn = packed_attention(q, k, v, docs, self.attention)
        attn = attn.reshape(tokens, self.heads * self.head_dim)
        x = x + self._row(self.proj, attn)
        h = copy_to_tp(self.ln2(x), self.tp)
        if self.swiglu:
            gate, up = self.gate_up(h).view(tokens, 2, -1).unbind(1)
            return x + self._row(self.fc2, F.silu(gate) * up)
        return x + self._row(self.fc2, F.gelu(self.fc1(h)))


def positions(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Position of every token within its own sequence."""
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])


class GPTStage(nn.Module):
    """Layers ``[first, last)`` of the model; the first stage embeds, the last one has the LM head.

    The whole model is ``GPTStage(cfg, 0, cfg.layers)``. With ``tp`` the decoder layers are
    tensor parallel (``resihp.model.tensor_parallel``); embeddings and head stay replicated, or with
    ``cfg.vocab_parallel`` are split by vocabulary rows (each rank ``ceil(vocab / tp)`` rows, the
    last ones padded; padded logits are dropped). With ``cfg.tie_embeddings`` the head is the token
    embedding: one parameter when one stage holds both, else a copy on the last stage whose
    gradient is summed with the first stage's (``resihp.train.gradsync``).
    """

    def __init__(
        self, cfg: GPTConfig, first: int = 0, last: int | None = None, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        last = cfg.layers if last is None else last
        if not 0 <= first < last <= cfg.layers:
            raise InputError(f"layer range [{first}, {last}) is not inside [0, {cfg.layers})")
        self.cfg, self.first, self.last = cfg, first, last
        self.is_first, self.is_last = first == 0, last == cfg.layers
        self.tp = tp or TPContext(1, 0)
        split = cfg.vocab_parallel and self.tp.size > 1
        self.vocab_rows = chunk_rows(cfg.vocab, self.tp.size) if split else cfg.vocab
        self.vocab_start = self.tp.rank * self.vocab_rows if split else 0
        if self.is_first:
            self.embed = nn.Embedding(self.vocab_rows, cfg.hidden)
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.layers = nn.ModuleDict(
            {str(i): DecoderBlock(cfg, self.tp) for i in range(first, last)}
        )
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, self.vocab_rows, bias=False)
            if cfg.tie_embeddings and self.is_first:
                self.head.weight = self.embed.weight

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_rows == self.cfg.vocab:
            return self.embed(ids)
        local = ids - self.vocab_start  # vocabulary parallel: rows of this rank, summed over tp
        mine = (local >= 0) & (local < self.vocab_rows)
        out = self.embed(torch.where(mine, local, torch.zeros_like(local))) * mine.unsqueeze(-1)
        return reduce_from_tp(out, self.tp)

    def forward(self, x: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """Token ids [T] on the first stage, hidden states [T, hidden] elsewhere."""
        if self.is_first:
            x = self._embed(x) + self.pos(positions(seq_lens, x.device))
        docs = PackedDocs.of(seq_lens, x.device)  # its masks built once, for every layer
        for layer in self.layers.values():
            x = layer(x, docs)
        if self.is_last:
            if self.vocab_rows == self.cfg.vocab:
                x = self.head(self.ln_f(x))
            else:  # vocabulary parallel: every rank's rows of the logits, padding dropped
                x = gather_from_tp(self.head(copy_to_tp(self.ln_f(x), self.tp)), self.tp)
                x = x[..., : self.cfg.vocab]
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss summed over the tokens of a micro-batch.

    The caller divides by the global token count, so the result does not depend on how tokens are
    split into micro-batches."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def init_by_name(
    module: nn.Module,
    seed: int,
    tp: TPContext | None = None,
    heads: int = 1,
    cfg: GPTConfig | None = None,
) -> None:
    """Initialise every parameter from a generator seeded by (seed, its global name).

    A layer starts from the same values whichever stage, replica, tensor-parallel rank or layout
    holds it (a tensor-parallel rank takes its block of the global tensor; padding rows are zero).

    Args:
        module: the module whose parameters are initialised in place.
        seed: the model's seed.
        tp: this rank's tensor-parallel group (None: no tensor parallelism).
        heads: unused; kept for callers that pass the attention heads.
        cfg: the options that place parameters (default: ``module.cfg`` where it has one).
    """
    import zlib

    tp = tp or TPContext(1, 0)
    cfg = cfg or getattr(module, "cfg", None) or GPTConfig()
    with torch.no_grad():
        for name, param in module.named_parameters():
            saved = cfg.saved_name(name)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(saved.encode()))
            leaf = name.rsplit(".", 1)[-1]
            if name.split(".")[-2].startswith("ln"):
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                param.zero_()
            else:
                where = cfg.shard_placement(saved, tuple(param.shape), tp.size)
                full = torch.empty(where.global_shape).normal_(0.0, 0.02, generator=gen)
                param.zero_()
                where.local_view(param, tp.size, tp.rank).copy_(where.block(full, tp.size, tp.rank))

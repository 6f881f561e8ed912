"""GPT-style decoder over packed variable-length sequences.

A micro-batch is one packed row of ``T`` tokens holding several documents; ``seq_lens`` gives their
lengths. Attention is causal *within* each document only (document masking), computed per sequence,
so its cost follows sum(l_i^2) rather than T^2.

Parameter names use the global layer index (``layers.7.qkv.weight``) whatever the pipeline layout,
so state can move between layouts by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from resihp.errors import InputError
from resihp.workload.flops import TransformerShape


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn_hidden: int = 1024
    vocab: int = 4096
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise InputError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise InputError(f"model config: hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    def shape(self, layers: int | None = None, tp: int = 1) -> TransformerShape:
        return TransformerShape(layers or self.layers, self.hidden, self.heads, self.ffn_hidden, tp)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int]
) -> torch.Tensor:
    """Causal attention inside each packed sequence. q, k, v: [T, heads, head_dim]."""
    outputs = []
    for qs, ks, vs in zip(
        q.split(list(seq_lens)), k.split(list(seq_lens)), v.split(list(seq_lens)), strict=True
    ):
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer: LayerNorm, packed causal self-attention, LayerNorm, GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        tokens, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(tokens, 3, self.heads, hidden // self.heads).unbind(1)
        x = x + self.proj(packed_causal_attention(q, k, v, seq_lens).reshape(tokens, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def positions(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Position of every token within its own sequence."""
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])


class GPTStage(nn.Module):
    """Layers ``[first, last)`` of the model; the first stage embeds, the last one has the LM head.

    The whole model is ``GPTStage(cfg, 0, cfg.layers)``.
    """

    def __init__(self, cfg: GPTConfig, first: int = 0, last: int | None = None) -> None:
        super().__init__()
        last = cfg.layers if last is None else last
        if not 0 <= first < last <= cfg.layers:
            raise InputError(f"layer range [{first}, {last}) is not inside [0, {cfg.layers})")
        self.cfg, self.first, self.last = cfg, first, last
        self.is_first, self.is_last = first == 0, last == cfg.layers
        if self.is_first:
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg) for i in range(first, last)})
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """Token ids [T] on the first stage, hidden states [T, hidden] elsewhere."""
        if self.is_first:
            x = self.embed(x) + self.pos(positions(seq_lens, x.device))
        for layer in self.layers.values():
            x = layer(x, seq_lens)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss summed over the tokens of a micro-batch (the caller divides by the global
    token count, so the result does not depend on how tokens are split into micro-batches)."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def init_by_name(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Initialise every parameter from a generator seeded by (seed, its global name), so that a
    layer starts from the same values whichever stage, replica or layout holds it."""
    import zlib

    with torch.no_grad():
        for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            leaf = name.rsplit(".", 1)[-1]
            if name.split(".")[-2].startswith("ln"):
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                param.zero_()
            else:
                full = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                param.copy_(full)

"""Causal attention over a packed row: each token attends to the earlier tokens of its own document.

Three ways compute the same function (``GPTConfig.attention``):

- ``per_document``: one SDPA call per document, on [heads, l_i, head_dim] slices; its work follows
  sum(l_i^2), but its calls follow the number of documents (launch-bound on a GPU).
- ``sdpa_masked``: one SDPA call per layer over the whole row with a [T, T] document-causal boolean
  mask; one call, but T^2 work whatever the packing.
- ``flex``: one ``flex_attention`` call with a document-causal block mask, which skips the blocks
  that the mask empties (work near sum(l_i^2) at the block size). On CUDA it runs compiled (a fused
  kernel); on CPU torch has no flex_attention backward, so there it serves inference only.

The masks depend only on the packing, so :class:`PackedDocs` builds them once per micro-batch and
every layer of a stage shares them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from resihp.errors import InputError
from resihp.model.config import ATTENTION_KINDS


@dataclass(frozen=True)
class PackedDocs:
    """The documents packed into one micro-batch row, and the masks built from them (lazily,
    once)."""

    seq_lens: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, seq_lens: Sequence[int] | PackedDocs, device: torch.device | str) -> PackedDocs:
        """``seq_lens`` as a ``PackedDocs`` on ``device`` (as it is when it already is one)."""
        if isinstance(seq_lens, PackedDocs):
            return seq_lens
        return cls(tuple(int(n) for n in seq_lens), torch.device(device))

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    @functools.cached_property
    def doc_ids(self) -> torch.Tensor:
        """Which document each token belongs to: [T] int64."""
        counts = torch.tensor(self.seq_lens, device=self.device)
        return torch.repeat_interleave(torch.arange(len(self.seq_lens), device=self.device), counts)

    @functools.cached_property
    def causal_mask(self) -> torch.Tensor:
        """[T, T] bool, True where query row i may attend to key column j."""
        ids = self.doc_ids
        same = ids.unsqueeze(1) == ids.unsqueeze(0)
        return torch.tril(same)

    @functools.cached_property
    def block_mask(self) -> BlockMask:
        """The document-causal mask in flex_attention's block form (empty blocks skipped)."""
        ids = self.doc_ids

        def document_causal(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return (ids[q] == ids[kv]) & (q >= kv)

        return create_block_mask(
            document_causal, None, None, self.tokens, self.tokens, device=self.device
        )


def per_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int]
) -> torch.Tensor:
    """Causal attention inside each packed sequence, one SDPA call each.

    Args:
        q: queries, [T, heads, dim] over the micro-batch's T tokens.
        k: keys, [T, heads, dim].
        v: values, [T, heads, dim].
        seq_lens: the packed sequences' lengths, summing to T.
    """
    outputs = []
    for qs, ks, vs in zip(
        q.split(list(seq_lens)), k.split(list(seq_lens)), v.split(list(seq_lens)), strict=True
    ):
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    # eager flex_attention is a reference implementation (the full score matrix); compiled is the
    # fused kernel, which is what a GPU should run
    attend = _compiled_flex() if q.is_cuda else flex_attention
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            return attend(q, k, v, block_mask=mask)
    except NotImplementedError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(
            f"model.attention (--attention) flex: not available for training on "
            f"{q.device.type} with torch {torch.__version__} ({first}); expected "
            "per_document or sdpa_masked there"
        ) from None


def check_attention(kind: str, device: torch.device | str) -> None:
    """Raise InputError before a run starts if attention ``kind`` cannot train on ``device``.

    It runs one tiny forward and backward there (a CUDA device is not probed: it would compile)."""
    device = torch.device(device)
    if kind != "flex" or device.type == "cuda":
        return
    q = torch.zeros(1, 1, 2, 8, device=device, requires_grad=True)
    docs = PackedDocs((1, 1), device)
    _flex(q, q, q, docs.block_mask).sum().backward()


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocs, kind: str = "per_document"
) -> torch.Tensor:
    """Document-causal attention over a packed row, computed the way ``kind`` says.

    Args:
        q: Queries, [T, heads, head_dim].
        k: Keys, like ``q``.
        v: Values, like ``q``.
        docs: The row's packing (its masks are built once and reused).
        kind: One of ``ATTENTION_KINDS``.

    Returns:
        [T, heads, head_dim], like ``q``.
    """
    if kind == "per_document":
        return per_document_attention(q, k, v, docs.seq_lens)
    if kind not in ATTENTION_KINDS:
        raise InputError(
            f"model.attention (--attention): expected one of "
            f"{', '.join(ATTENTION_KINDS)}, got {kind!r}"
        )
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, head_dim]
    if kind == "sdpa_masked":
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=docs.causal_mask)
    else:
        out = _flex(qh, kh, vh, docs.block_mask)
    return out.squeeze(0).transpose(0, 1)

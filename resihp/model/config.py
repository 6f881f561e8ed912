"""The runnable GPT model's shape (torch-free: the run configuration's ``model`` section)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from resihp.errors import InputError
from resihp.model.shards import ShardPlacement, shard_placement
from resihp.options import Section, check_section, opt
from resihp.workload.flops import TransformerShape

# how attention over a packed row is computed (the same function; ``resihp.model.attention``)
ATTENTION_KINDS = ("per_document", "sdpa_masked", "flex")


@dataclass(frozen=True)
class GPTConfig(Section):
    """The model's shape: the ``model`` section of a run's configuration."""

    SECTION: ClassVar[str] = "model"

    layers: int = opt(4, help="Transformer layers", minimum=1, panel="Model")
    hidden: int = opt(256, help="Hidden size", minimum=1, panel="Model")
    heads: int = opt(
        4, help="Attention heads (divide --hidden; --tp divides them)", minimum=1, panel="Model"
    )
    ffn_hidden: int = opt(1024, help="Feed-forward hidden size", minimum=1, panel="Model")
    vocab: int = opt(4096, help="Vocabulary size", minimum=1, panel="Model")
    max_seq_len: int = opt(
        2048,
        flag="max-len",
        help="Longest sequence; longer documents are chunked",
        minimum=1,
        maximum=2**31,
        panel="Model",
    )
    # options (in ``to_dict`` only when set, so that a model without them keeps its hash)
    mlp: str = opt(
        "gelu",
        choices=("gelu", "swiglu"),
        panel="Model",
        help="gelu, or swiglu (a fused gate/up projection, split per half)",
    )
    tie_embeddings: bool = opt(
        False,
        panel="Model",
        help="Tie the LM head to the token embedding (across the first and last pipeline stage)",
    )
    vocab_parallel: bool = opt(
        False,
        panel="Model",
        help="Split the embedding and LM head by "
        "vocabulary rows over --tp (the vocabulary padded to a multiple of it)",
    )
    # how, not what: left out of ``to_dict``, so a checkpoint resumes under any of them
    attention: str = opt(
        "per_document",
        choices=ATTENTION_KINDS,
        panel="Model",
        help="per_document (one SDPA call per document), sdpa_masked (one call "
        "with a document-causal mask) or flex (one flex_attention call with a "
        "document block mask; CUDA for training)",
    )

    def __post_init__(self) -> None:
        check_section(self)
        if self.hidden % self.heads:
            raise InputError(
                f"model.hidden (--hidden): {self.hidden} must be divisible by "
                f"model.heads (--heads) {self.heads}"
            )

    def check_tp(self, tp: int) -> None:
        """Tensor parallelism of size ``tp`` splits whole heads and the FFN evenly."""
        if self.heads % tp or self.ffn_hidden % tp:
            raise InputError(
                f"parallel.tp (--tp {tp}): must divide model.heads (--heads {self.heads}) "
                f"and model.ffn_hidden (--ffn-hidden {self.ffn_hidden})"
            )

    def saved_name(self, name: str) -> str:
        """The global name a parameter is saved and initialised under.

        A tied LM head is the token embedding, wherever the stage holding it sits."""
        return "embed.weight" if self.tie_embeddings and name == "head.weight" else name

    def shard_placement(self, name: str, local_shape: tuple[int, ...], tp: int) -> ShardPlacement:
        """Where a rank's shard of parameter ``name`` sits in its global tensor.

        Args:
            name: the parameter's name.
            local_shape: its shape on this rank.
            tp: the tensor-parallel size."""
        return shard_placement(name, local_shape, tp, self.vocab if self.vocab_parallel else None)

    def shape(self, layers: int | None = None, tp: int = 1) -> TransformerShape:
        return TransformerShape(layers or self.layers, self.hidden, self.heads, self.ffn_hidden, tp)

    def to_dict(self) -> dict[str, int | str | bool]:
        """What the parameters depend on (options only where set): the model's hash and meta."""
        return {
            k: v
            for k, v in asdict(self).items()
            if k not in COMPUTE_ONLY and (k not in OPTIONS or v != OPTIONS[k])
        }


OPTIONS = {"mlp": "gelu", "tie_embeddings": False, "vocab_parallel": False}  # option: its default
COMPUTE_ONLY = ("attention",)  # fields that change how it runs, not its tensors

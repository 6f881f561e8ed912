"""Applying a new plan to a running job at a step boundary, without losing a step's mathematics.

- micro-batch re-allocation: the replicas' shares of each step's micro-batches change; the global
  batch, and so the loss (summed over tokens / global tokens) and gradients, stay the same;
- layer re-partitioning: contiguous layer ranges move between the stages of every pipeline; each
  moved layer's parameters and AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``) go from the old
  owner to the new one by global name, over point-to-point sends walked in global layer order (so
  every rank's sends and receives are in one consistent order and cannot deadlock).

A plan change is a ``planchange.PlanChange`` (its JSON form: ``{"version", "dp_weights"?,
"layer_split"? | "layer_splits"?, "reason"?}``); pipelines may split their layers differently
(``gradsync`` sums each layer's gradient over whichever stages hold it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from resihp.model.gpt import ADAM_KEYS, DecoderBlock, GPTConfig, GPTStage
from resihp.model.tensor_parallel import TPContext


def owner(ranges: Sequence[tuple[int, int]], layer: int) -> int:
    return next(s for s, (a, b) in enumerate(ranges) if a <= layer < b)


def layer_state(model: GPTStage, optimizer: torch.optim.Optimizer, layer: int) -> list[torch.Tensor]:
    """A layer's parameters and AdamW state as a flat list in a fixed order."""
    out = []
    for _, p in sorted(model.layers[str(layer)].named_parameters()):
        state = optimizer.state.get(p, {})
        out.append(p.detach())
        for key in ADAM_KEYS:
            value = state.get(key)
            out.append(torch.zeros(1 if key == "step" else p.shape, device=p.device) if value is None
                       else value.detach().reshape(1 if key == "step" else p.shape).float())
    return out


def layer_templates(cfg: GPTConfig, tp: TPContext) -> list[tuple[int, ...]]:
    """Shapes, in ``layer_state`` order, of one layer's tensors on this tensor-parallel rank."""
    block = DecoderBlock(cfg, tp)
    shapes = []
    for _, p in sorted(block.named_parameters()):
        shapes += [tuple(p.shape), (1,), tuple(p.shape), tuple(p.shape)]
    return shapes


def repartition(model: GPTStage, optimizer: torch.optim.Optimizer, cfg: GPTConfig, tp: TPContext,
                old_ranges: Sequence[tuple[int, int]], new_ranges: Sequence[tuple[int, int]], stage: int,
                peer_of: Callable[[int], int], lr: float,
                device: torch.device) -> tuple[GPTStage, torch.optim.Optimizer, int]:
    """Move layers between the stages of this rank's pipeline (``peer_of(stage)``: the rank holding
    that stage beside this one); returns the new stage model, its optimizer and the bytes sent."""
    moved: dict[int, list[torch.Tensor]] = {}
    sent = 0
    shapes = None
    for layer in range(cfg.layers):
        src, dst = owner(old_ranges, layer), owner(new_ranges, layer)
        if src == dst or stage not in (src, dst):
            continue
        peer = peer_of(dst if stage == src else src)
        if stage == src:
            for t in layer_state(model, optimizer, layer):
                dist.send(t.contiguous(), peer)
                sent += t.numel() * t.element_size()
        else:
            shapes = shapes or layer_templates(cfg, tp)
            bufs = [torch.empty(s, device=device) for s in shapes]
            for b in bufs:
                dist.recv(b, peer)
            moved[layer] = bufs
    kept = {layer: layer_state(model, optimizer, layer)
            for layer in range(*new_ranges[stage]) if layer not in moved}
    ends = {n: p.detach() for n, p in model.named_parameters() if not n.startswith("layers.")}
    end_state = {n: optimizer.state.get(p, {}) for n, p in model.named_parameters()
                 if not n.startswith("layers.")}
    model = GPTStage(cfg, *new_ranges[stage], tp).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with torch.no_grad():
        for layer, tensors in {**kept, **moved}.items():
            params = sorted(model.layers[str(layer)].named_parameters())
            for i, (_, p) in enumerate(params):
                value, step, avg, avg_sq = tensors[4 * i: 4 * i + 4]
                p.copy_(value)
                optimizer.state[p] = {"step": step.reshape(()).clone(), "exp_avg": avg.clone(),
                                      "exp_avg_sq": avg_sq.clone()}
        for name, p in model.named_parameters():
            if name in ends:
                p.copy_(ends[name])
                if end_state[name]:
                    optimizer.state[p] = {k: v.clone() for k, v in end_state[name].items()}
    return model, optimizer, sent

"""What a mixture-of-experts model's routers did in one forward: the load-balancing loss and how evenly the tokens
spread over the experts, logged each training step as train/moe_aux_loss and train/moe_load_cv.

Both backends route in a `...TopKRouter` module, and a forward hook on each reads what it decided (`hf_routing`,
`megatron_routing`). Padding tokens (past a row's length) are left out when the caller marks them.

- moe_aux_loss: the Switch Transformer load-balancing loss, `experts x sum_e f_e P_e` (f_e: the share of the
  tokens' k choices that went to expert e, P_e: its mean router probability), averaged over the MoE layers: k when
  the load is even, up to k x experts when every token picks the same experts. It is logged, not trained on: the
  policy's loss is the algorithm's.
- moe_load_cv: the coefficient of variation (std / mean) of the tokens each expert received, averaged over the
  layers: 0 when even.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

Routing = Callable[[nn.Module, tuple[Any, ...], Any], tuple[torch.Tensor, torch.Tensor]]
"""(router, its forward's arguments, its result) -> (router logits [tokens, experts], chosen experts [tokens, k])."""


def hf_routing(module: nn.Module, args: tuple[Any, ...], result: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routers return (router logits, scores, chosen experts)."""
    return result[0].detach(), result[-1].detach()


def megatron_routing(module: Any, args: tuple[Any, ...], result: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's TopKRouter returns (probabilities of the chosen, routing map [tokens, experts]); its logits are
    the gate's linear layer on its input ([S, B, H]: tokens in sequence-major order), computed again here in fp32."""
    hidden = args[0].detach()
    weight = module.weight.detach().float()
    bias = module.bias.detach().float() if getattr(module, "bias", None) is not None else None
    logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight, bias)
    chosen = result[1].detach().float().topk(int(module.topk), dim=-1).indices
    return logits, chosen


def row_tokens(input_ids: torch.Tensor, input_lengths: torch.Tensor, sequence_major: bool = False) -> torch.Tensor:
    """The tokens of a padded batch [B, S] within their row's length, flattened in the order a router sees them:
    row by row ([B x S], transformers), or position by position ([S x B], megatron-core's [S, B, H] layout)."""
    valid = torch.arange(input_ids.shape[1])[None, :] < input_lengths.cpu()[:, None]  # [B, S]
    return (valid.T if sequence_major else valid).reshape(-1)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def layer_stats(logits: torch.Tensor, chosen: torch.Tensor, experts: int) -> tuple[float, float]:
    """(load-balancing loss, load coefficient of variation) of one layer's routing of some tokens."""
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.bincount(chosen.reshape(-1), minlength=experts).float()
    share = counts / max(chosen.numel(), 1)
    aux = float(experts * (share * probs.mean(0)).sum() * chosen.shape[-1])
    cv = float(counts.std(correction=0) / counts.mean()) if counts.sum() else 0.0
    return aux, cv


@contextmanager
def router_stats(modules: list[nn.Module], valid: torch.Tensor | None, read: Routing = hf_routing
                 ) -> Iterator[dict[str, float]]:
    """Within the block, record each router's choices; on leaving, the dict holds moe_aux_loss and moe_load_cv
    (nothing for a dense model). `valid` [tokens] marks the tokens counted, in the order the routers see them (None,
    or a different count of tokens, as a context-parallel rank's: all)."""
    out: dict[str, float] = {}
    if not modules:
        yield out
        return
    seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def hook(module: nn.Module, args: tuple[Any, ...], result: Any) -> None:
        logits, chosen = read(module, args, result)
        if valid is not None and valid.numel() == logits.shape[0]:
            logits, chosen = logits[valid], chosen[valid]
        seen.append((logits, chosen, int(getattr(module, "num_experts", logits.shape[-1]))))

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
    if seen:
        stats = [layer_stats(*s) for s in seen]
        out["moe_aux_loss"] = sum(a for a, _ in stats) / len(stats)
        out["moe_load_cv"] = sum(c for _, c in stats) / len(stats)

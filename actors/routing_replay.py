"""Routing replay (rollout.routing_replay: rollout; "R3"): every trainer forward of a sample routes
each token of each MoE layer to the experts the engine routed it to when it sampled the response,
instead of the trainer's own top-k. With bf16 kernels the two routers pick different experts for a
share of tokens, and the importance ratios of those tokens explode (verl examples/router_replay,
slime, NeMo-RL docs/guides/router-replay.md).

The gating weights of the replayed experts come from the trainer's own router: softmax over all the
router's logits, taken at the replayed experts, renormalised over them when the model normalises its
top-k (norm_topk_prob). That is the definition slime's and verl's Megatron replay use (the indices
replaced, the probabilities still the trainer's), so the router keeps its gradient.

How: a forward hook on each router (transformers 5's `*TopKRouter`, which returns
(logits, scores, indices)) replaces scores and indices when the micro-batch carries routes; a token
without one (padding, a response's last token, which the engine never forwarded) keeps its own.
The routes stay set from one forward to the next, so gradient checkpointing's recomputation in the
backward replays them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> its MoE router: a module with `top_k`, `num_experts` and a `weight`,
    whose forward returns (logits, scores, indices)."""
    routers = {}
    for name, module in model.named_modules():
        if all(hasattr(module, attribute) for attribute in ("top_k", "num_experts", "weight")) and (
                match := _LAYER.search(name + ".")):
            routers[int(match.group(1))] = module
    return routers


@dataclass
class RoutingCounts:
    """Over a forward: the (token, layer) pairs that had an engine route, and those where the
    trainer's own top-k set differs from the engine's."""

    routed: float = 0.0
    differing: float = 0.0


class RouteReplay:
    """The hooks on one model's routers and the routes they replay."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay needs a mixture-of-experts model; {type(model).__name__} has no "
                             "MoE router (a module with top_k, num_experts and weight under layers.N)")
        self.routes: torch.Tensor | None = None  # [tokens, layers, top_k], -1: no route (own top-k)
        self.counts = RoutingCounts()
        self._handles = [router.register_forward_hook(self._hook_for(layer)) for layer, router in self.routers.items()]

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """Routes of the next forward's tokens, flattened in the model's token order ([B * T, L, K]), or
        None: the routers route by themselves. Kept until set again (a recomputed forward replays them)."""
        self.routes = routes
        self.counts = RoutingCounts()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook_for(self, layer: int):
        def hook(module, args, output):
            if self.routes is None:
                return None
            logits, _scores, own = output
            routes = self.routes[:, layer, :].to(own.device)
            if routes.shape != own.shape:
                raise ValueError(f"routing replay: layer {layer} routes {own.shape[0]} tokens to {own.shape[1]} "
                                 f"experts each, but the batch carries routes of shape {tuple(routes.shape)}")
            has_route = routes[:, 0] >= 0
            indices = torch.where(has_route[:, None], routes.to(own.dtype), own)
            with torch.no_grad():
                same = torch.sort(indices, dim=-1).values == torch.sort(own, dim=-1).values
                self.counts.routed += has_route.sum().item()
                self.counts.differing += (has_route & ~same.all(dim=-1)).sum().item()
            probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
            scores = probabilities.gather(1, indices)
            if _renormalises(module, _scores, probabilities.gather(1, own)):
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), indices
        return hook


def _renormalises(router: torch.nn.Module, scores: torch.Tensor, own_probabilities: torch.Tensor) -> bool:
    """Whether the router divides its top-k probabilities by their sum: its `norm_topk_prob` where it
    has one (Qwen-MoE), else read from what it returned (Mixtral always does)."""
    flag = getattr(router, "norm_topk_prob", None)
    if flag is not None:
        return bool(flag)
    return not torch.allclose(scores.detach().float(), own_probabilities, rtol=1e-3, atol=1e-6)

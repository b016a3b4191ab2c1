"""LossSums: a rank's token sums over its micro-batches of a step, all-reduced over the ranks and
then divided into the step's per-token metrics (loss, clip fractions, KL, entropy, the
engine/trainer mismatch and what the corrections did)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from rlsys.algorithms.policy_losses import PolicyLoss


@dataclass
class LossSums:
    """Token sums of one rank's micro-batches; all-reduced, then divided into per-token metrics."""

    objective: float = 0.0  # sum of w * token loss (policy incl. KL and entropy terms): the loss minimised
    kl: float = 0.0
    clipped: float = 0.0
    entropy: float = 0.0
    logprob_mismatch: float = 0.0  # |old - engine| over tokens with an engine log-prob
    # rho = exp(old - engine) over those tokens: k1 and k3 estimates of KL(engine || trainer), and rho
    rollout_k1: float = 0.0
    rollout_k3: float = 0.0
    rollout_ratio: float = 0.0
    tis_weight: float = 0.0  # the corrections' importance weights, over tokens with an engine log-prob
    tis_clipped: float = 0.0  # tokens whose weight was truncated
    masked_tokens: float = 0.0  # loss tokens a correction rejected
    masked_sequences: float = 0.0  # sequences with a rejected loss token ...
    corrected_sequences: float = 0.0  # ... of these, the sequences with a loss token
    routed: float = 0.0  # routing replay: (token, MoE layer) pairs with an engine route ...
    routed_differing: float = 0.0  # ... of them, those where the trainer's own top-k differs from the engine's
    policy_weight: float = 0.0  # the policy loss's own weight per token, if it has one, over loss tokens
    sequences: float = 0.0  # sequences with a loss token (counted for sequence-ratio losses only)
    clipped_sequences: float = 0.0
    tokens: float = 0.0
    engine_tokens: float = 0.0
    mini_batches: float = 0.0

    # The smallest and largest rho (inf, -inf: no engine-scored token yet); reduced by MIN and MAX.
    rollout_ratio_min: float = math.inf
    rollout_ratio_max: float = -math.inf

    def __iadd__(self, other: LossSums) -> LossSums:
        for name, value in asdict(other).items():
            if name not in _EXTREMES:
                setattr(self, name, getattr(self, name) + value)
        self.rollout_ratio_min = min(self.rollout_ratio_min, other.rollout_ratio_min)
        self.rollout_ratio_max = max(self.rollout_ratio_max, other.rollout_ratio_max)
        return self

    def all_reduced(self, device) -> LossSums:
        sums = {name: value for name, value in asdict(self).items() if name not in _EXTREMES}
        values = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        # max(-min, max) in one collective
        extremes = torch.tensor([-self.rollout_ratio_min, self.rollout_ratio_max], dtype=torch.float64, device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        low, high = extremes.cpu().tolist()
        return LossSums(**dict(zip(sums, values.cpu().tolist(), strict=True)), rollout_ratio_min=-low,
                        rollout_ratio_max=high)

    def metrics(self, with_corrections: bool, policy_loss: PolicyLoss) -> dict[str, float]:
        """The loss per mini-batch; the rest per loss token (per engine-scored token for the
        engine/trainer mismatch and the importance weights, per sequence for seq_clip_fraction and
        masked_sequence_fraction), and the policy loss's own (`weight_metrics`)."""
        tokens, engine_tokens = max(self.tokens, 1.0), max(self.engine_tokens, 1.0)
        metrics = {
            "loss": self.objective / max(self.mini_batches, 1.0),
            "kl": self.kl / tokens,
            "clip_fraction": self.clipped / tokens,
            "entropy": self.entropy / tokens,
            "logprob_mismatch": self.logprob_mismatch / engine_tokens,
            "train_tokens": self.tokens,
        }
        if self.engine_tokens:
            metrics.update(rollout_k1=self.rollout_k1 / engine_tokens, rollout_k3=self.rollout_k3 / engine_tokens,
                           rollout_ratio_mean=self.rollout_ratio / engine_tokens,
                           rollout_ratio_min=self.rollout_ratio_min, rollout_ratio_max=self.rollout_ratio_max)
        if self.routed:
            metrics["routing_mismatch_fraction"] = self.routed_differing / self.routed
        if with_corrections:
            metrics.update(tis_weight_mean=self.tis_weight / engine_tokens,
                           tis_clipped_fraction=self.tis_clipped / engine_tokens,
                           masked_token_fraction=self.masked_tokens / tokens)
            if self.corrected_sequences:  # (not counted under context parallelism)
                metrics["masked_sequence_fraction"] = self.masked_sequences / self.corrected_sequences
        if policy_loss.one_ratio_per_sequence:
            metrics["seq_clip_fraction"] = self.clipped_sequences / max(self.sequences, 1.0)
        return {**metrics, **policy_loss.weight_metrics(self.policy_weight / tokens)}


_EXTREMES = ("rollout_ratio_min", "rollout_ratio_max")


def mismatch_sums(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, engine_mask: torch.Tensor) -> dict:
    """The engine/trainer mismatch of a micro-batch's engine-scored tokens, as LossSums' fields:
    rho = pi_old / pi_engine; k1 = log pi_engine - log pi_old and k3 = rho - log rho - 1, whose means
    estimate KL(engine || trainer) (verl's rollout_corr metrics); rho's sum, min and max."""
    if not engine_mask.any():
        return {}
    log_rho = (old_logprobs - engine_logprobs)[engine_mask > 0]
    rho = torch.exp(log_rho)
    return {"rollout_k1": (-log_rho).sum().item(), "rollout_k3": (rho - log_rho - 1.0).sum().item(),
            "rollout_ratio": rho.sum().item(), "rollout_ratio_min": rho.min().item(),
            "rollout_ratio_max": rho.max().item()}



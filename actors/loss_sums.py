"""LossSums: a rank's token sums over its micro-batches of a step, all-reduced over the ranks and
then divided into the step's per-token metrics (loss, clip fractions, KL, entropy, the
engine/trainer mismatch and what the corrections did).

The sums stay device tensors through the step (a field is a float until a tensor is added to it):
reading one on the host (`.item()`) waits for the device, and a step used to do that a dozen
times per micro-batch. `all_reduced` copies them to the host once, after its all-reduce."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        for name, value in _fields(other).items():
            if name not in _EXTREMES:  # (tensors summed in float64, as the floats they replace were)
                setattr(self, name, getattr(self, name) + (value.double() if isinstance(value, torch.Tensor) else value))
        self.rollout_ratio_min = _extreme(torch.minimum, min, self.rollout_ratio_min, other.rollout_ratio_min)
        self.rollout_ratio_max = _extreme(torch.maximum, max, self.rollout_ratio_max, other.rollout_ratio_max)
        return self

    def all_reduced(self, device) -> LossSums:
        """The ranks' sums (and extremes), as floats: one host copy of each collective's result."""
        fields = _fields(self)
        sums = {name: value for name, value in fields.items() if name not in _EXTREMES}
        values = _packed(list(sums.values()), device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        # max(-min, max) in one collective
        extremes = _packed([-fields["rollout_ratio_min"], fields["rollout_ratio_max"]], device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        low, high = extremes.cpu().tolist()
        return LossSums(**dict(zip(sums, values.cpu().tolist(), strict=True)), rollout_ratio_min=-low,
                        rollout_ratio_max=high)

    def floats(self) -> LossSums:
        """These sums with every field a float (read from the device: a wait)."""
        return LossSums(**{name: float(value) for name, value in _fields(self).items()})

    def metrics(self, with_corrections: bool, policy_loss: PolicyLoss) -> dict[str, float]:
        """The loss per mini-batch; the rest per loss token (per engine-scored token for the
        engine/trainer mismatch and the importance weights, per sequence for seq_clip_fraction and
        masked_sequence_fraction), and the policy loss's own (`weight_metrics`)."""
        if any(isinstance(value, torch.Tensor) for value in _fields(self).values()):
            return self.floats().metrics(with_corrections, policy_loss)
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


def _fields(sums: LossSums) -> dict:
    """The fields, as they are (floats or tensors); dataclasses.asdict would deep-copy the tensors."""
    return {name: getattr(sums, name) for name in sums.__dataclass_fields__}


def _extreme(of_tensors, of_floats, a, b):
    """min or max of two values, either a float or a 0-dim tensor, without reading a tensor."""
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return of_floats(a, b)
    device = a.device if isinstance(a, torch.Tensor) else b.device
    return of_tensors(torch.as_tensor(a, dtype=torch.float64, device=device),
                      torch.as_tensor(b, dtype=torch.float64, device=device))


def _packed(values: list, device) -> torch.Tensor:
    """One float64 tensor on `device` of floats and 0-dim tensors: the floats in one copy to the
    device, the tensors stacked there."""
    packed = torch.tensor([0.0 if isinstance(v, torch.Tensor) else float(v) for v in values], dtype=torch.float64,
                          device=device)
    on_device = [index for index, value in enumerate(values) if isinstance(value, torch.Tensor)]
    if on_device:
        packed[on_device] = torch.stack([values[index].to(device=device, dtype=torch.float64).reshape(())
                                         for index in on_device])
    return packed


def mismatch_sums(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, engine_mask: torch.Tensor) -> dict:
    """The engine/trainer mismatch of a micro-batch's engine-scored tokens, as LossSums' fields (0-dim
    tensors, nothing read from the device): rho = pi_old / pi_engine; k1 = log pi_engine - log pi_old
    and k3 = rho - log rho - 1, whose means estimate KL(engine || trainer) (verl's rollout_corr
    metrics); rho's sum, min and max (inf and -inf without an engine-scored token)."""
    if engine_mask.numel() == 0:  # a rank's empty micro-batch (padding the ranks' counts)
        return {}
    scored = engine_mask > 0
    log_rho = torch.where(scored, old_logprobs - engine_logprobs, 0.0)
    rho = torch.exp(log_rho)
    return {"rollout_k1": torch.where(scored, -log_rho, 0.0).sum(),
            "rollout_k3": torch.where(scored, rho - log_rho - 1.0, 0.0).sum(),
            "rollout_ratio": torch.where(scored, rho, 0.0).sum(),
            "rollout_ratio_min": torch.where(scored, rho, math.inf).min(),
            "rollout_ratio_max": torch.where(scored, rho, -math.inf).max()}



"""The output layer, turned into one that can return token log-probs instead of logits.

A trainer needs, per response token, log p(token) and sometimes the entropy; never the logits.
`LogProbHead` replaces the model's `lm_head` before sharding and keeps its very parameter (same
name, same tie to the embeddings, same FSDP group), so checkpoints, weight sync and export see
the model unchanged. Inside `head.computing(targets, ...)`, the model's forward returns, in place
of logits, a [batch, seq, 1 or 2] tensor of (log-prob, entropy) computed in chunks of tokens
(actors/chunked_logprobs.py): no full-vocabulary tensor is kept for backward. Outside it the
head is the plain linear layer it replaced.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlsys.actors.chunked_logprobs import target_logprobs, target_logprobs_reference


@dataclass
class _Request:
    targets: torch.Tensor  # [batch, seq]: the token each position predicts (any id where unused)
    temperature: float
    with_entropy: bool
    chunk_tokens: int  # 0: the unchunked full-vocabulary path (kept for comparison: bench/memory.py)


class LogProbHead(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight  # the same Parameter: ties and names are preserved
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._request: _Request | None = None

    @contextmanager
    def computing(self, targets: torch.Tensor, temperature: float, with_entropy: bool, chunk_tokens: int):
        """Forwards inside return (log-prob, [entropy]) per position instead of logits."""
        self._request = _Request(targets, temperature, with_entropy, chunk_tokens)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._request
        if request is None:
            return torch.nn.functional.linear(hidden, self.weight, self.bias)
        compute = target_logprobs if request.chunk_tokens > 0 else _unchunked
        logprobs, entropy = compute(hidden, self.weight, request.targets, request.temperature,
                                    request.chunk_tokens, request.with_entropy, bias=self.bias)
        parts = [logprobs] if entropy is None else [logprobs, entropy]
        return torch.stack(parts, dim=-1)


def _unchunked(hidden, weight, targets, temperature, chunk_tokens, with_entropy, bias=None):
    return target_logprobs_reference(hidden, weight, targets, temperature, with_entropy, bias=bias)


def install_logprob_head(model: torch.nn.Module) -> LogProbHead:
    """Swap the model's output layer for a `LogProbHead` (before `fully_shard`)."""
    head = model.get_output_embeddings()
    if isinstance(head, LogProbHead):
        return head
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"cannot compute log-probs from a {type(head).__name__} output layer")
    replacement = LogProbHead(head)
    model.set_output_embeddings(replacement)
    return replacement

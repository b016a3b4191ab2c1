"""Turn training sequences into padded micro-batches with response masks.

A `TrainSequence` is prompt + response token ids; the trainer scores the response tokens only.
Targets are shifted by one: position t predicts token t + 1, so response tokens of a sequence
with prompt length P and total length L sit at target positions P - 1 .. L - 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainSequence:
    token_ids: list[int]
    prompt_len: int
    advantage: float = 0.0
    engine_logprobs: list[float] = field(default_factory=list)  # one per response token

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T-1]
    response_mask: torch.Tensor  # [B, T-1] float
    advantages: torch.Tensor  # [B, 1]
    engine_logprobs: torch.Tensor  # [B, T-1], 0 outside the response
    engine_mask: torch.Tensor  # [B, T-1] float: response tokens that have an engine log-prob
    indices: list[int]  # positions of these sequences in the caller's list

    @property
    def num_tokens(self) -> float:
        return float(self.response_mask.sum())


def build_micro_batch(
    sequences: list[TrainSequence], indices: list[int], pad_id: int, device: torch.device
) -> MicroBatch:
    """Right-padded batch; an empty list gives a one-token dummy row with an all-zero mask."""
    if not sequences:
        # A rank with no data still joins FSDP's collectives with a dummy forward/backward.
        sequences = [TrainSequence(token_ids=[pad_id, pad_id], prompt_len=2)]
        indices = []
    width = max(len(s.token_ids) for s in sequences)
    batch = len(sequences)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    response_mask = torch.zeros((batch, width - 1))
    engine_logprobs = torch.zeros((batch, width - 1))
    engine_mask = torch.zeros((batch, width - 1))
    for row, seq in enumerate(sequences):
        if seq.prompt_len < 1:
            raise ValueError("a training sequence needs at least one prompt token")
        length = len(seq.token_ids)
        input_ids[row, :length] = torch.tensor(seq.token_ids)
        attention_mask[row, :length] = 1
        response_mask[row, seq.prompt_len - 1:length - 1] = 1.0
        if seq.engine_logprobs:
            if len(seq.engine_logprobs) != seq.response_len:
                raise ValueError(
                    f"{len(seq.engine_logprobs)} engine log-probs for {seq.response_len} response tokens"
                )
            engine_logprobs[row, seq.prompt_len - 1:length - 1] = torch.tensor(seq.engine_logprobs)
            engine_mask[row, seq.prompt_len - 1:length - 1] = 1.0
    advantages = torch.tensor([[s.advantage] for s in sequences], dtype=torch.float32)
    if not indices:
        response_mask.zero_()
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        targets=input_ids[:, 1:].to(device),
        response_mask=response_mask.to(device),
        advantages=advantages.to(device),
        engine_logprobs=engine_logprobs.to(device),
        engine_mask=(engine_mask * response_mask).to(device),
        indices=list(indices),
    )


def split_evenly(items: list, parts: int) -> list[list]:
    """`parts` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks

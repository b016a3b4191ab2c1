"""Where context parallelism puts a packed micro-batch's tokens: the CP groups, each sequence
padded to a multiple of 2 x CP and cut into 2 x CP chunks (CP rank r keeps chunks r and 2CP-1-r:
zigzag), and each rank's ring steps. What actors/batching.py and actors/context_parallel.py both
need, with neither importing the other back (actors/context_parallel.py tells the whole scheme)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.distributed as dist

from rlsys.actors.ring_attention import Segments

Style = Literal["ring", "ulysses"]


@dataclass(frozen=True)
class ContextParallelGroup:
    """This rank's CP group: the process group, its rank in it, the group's size and style."""

    group: object
    rank: int
    size: int
    style: Style = "ring"


def new_context_parallel_groups(world_size: int, rank: int, size: int, style: Style) -> ContextParallelGroup | None:
    """Every rank creates every group (torch's new_group is collective), keeping its own; None for CP 1."""
    if size == 1:
        return None
    mine = None
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = ContextParallelGroup(group, rank - first, size, style)
    return mine


def check_ulysses_heads(heads: int, kv_heads: int, size: int) -> None:
    """Ulysses gives each CP rank heads / CP of the heads: both head counts must divide."""
    if heads % size or kv_heads % size:
        raise ValueError(f"trainer.context_parallel_style=ulysses splits attention heads over the CP group: the model's "
                         f"{heads} attention heads and {kv_heads} key/value heads must both divide by "
                         f"context_parallel_size={size}; use context_parallel_style=ring or a CP size dividing both")


def padded_length(length: int, size: int) -> int:
    """A sequence's length padded to a multiple of 2 x CP."""
    return math.ceil(length / (2 * size)) * 2 * size


def zigzag_positions(length: int, size: int, rank: int) -> list[int]:
    """Positions (in the padded sequence) of CP rank `rank`'s chunks: r, then 2CP-1-r."""
    chunk = padded_length(length, size) // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return [*range(first, first + chunk), *range(second, second + chunk)]


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where a packed micro-batch's tokens went: per CP rank, each local token's index in the
    unsplit row (-1: padding). Built identically on every rank of the group."""

    cp: ContextParallelGroup
    lengths: tuple[int, ...]  # the sequences' own lengths, in row order
    sources: tuple[torch.Tensor, ...]  # per CP rank: [T_local] indices into the unsplit row, -1 = padding
    row_length: int  # tokens of the unsplit row
    steps: tuple[Segments, ...] = field(default=(), compare=False)  # ring: this rank's per-step layouts

    @property
    def local_sources(self) -> torch.Tensor:
        return self.sources[self.cp.rank]

    @property
    def chunk_lengths(self) -> list[int]:
        return [padded_length(length, self.cp.size) // (2 * self.cp.size) for length in self.lengths]


def build_layout(lengths: list[int], cp: ContextParallelGroup, device: torch.device) -> ContextParallelLayout:
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()] if lengths else [0]
    sources = []
    for rank in range(cp.size):
        index = []
        for offset, length in zip(offsets, lengths, strict=False):
            index += [offset + p if p < length else -1 for p in zigzag_positions(length, cp.size, rank)]
        sources.append(torch.tensor(index, dtype=torch.long, device=device))
    layout = ContextParallelLayout(cp, tuple(lengths), tuple(sources), sum(lengths))
    if cp.style == "ring":
        layout = replace(layout, steps=ring_steps(layout.chunk_lengths, cp, device))
    return layout


def ring_steps(chunks: list[int], cp: ContextParallelGroup, device: torch.device) -> tuple[Segments, ...]:
    """This rank's varlen layout for each ring step (see actors/ring_attention.py's table): local
    rows are, per sequence, [first chunk | second chunk], each `chunks[i]` tokens."""
    first, second, starts = [], [], []
    offset = 0
    for chunk in chunks:
        first += range(offset, offset + chunk)
        second += range(offset + chunk, offset + 2 * chunk)
        starts.append(offset)
        offset += 2 * chunk
    both = list(range(offset))
    as_index = lambda items: torch.tensor(items, dtype=torch.long, device=device)  # noqa: E731
    whole, halves = tuple(2 * c for c in chunks), tuple(chunks)
    steps = []
    for step in range(cp.size):
        source = (cp.rank - step) % cp.size
        if step == 0:
            steps.append(Segments(as_index(both), as_index(both), whole, whole, causal=True))
        elif source < cp.rank:
            steps.append(Segments(as_index(both), as_index(first), whole, halves, causal=False))
        else:
            steps.append(Segments(as_index(second), as_index(both), halves, whole, causal=False))
    return tuple(steps)

"""Turn training sequences into micro-batches: packed back to back (default) or right-padded.

A `TrainSequence` is prompt + response token ids; the trainer scores the response tokens only.
Targets are shifted by one: position t predicts token t + 1, so the response tokens of a sequence
with prompt length P and total length L sit at target positions P - 1 .. L - 2 of its row.

Packed: one row holding every sequence of the micro-batch, `position_ids` restarting at 0 for
each and no attention mask, plus the sequences' boundaries (`cu_seq_lens`, `max_length`) built here
from the lengths the batch already knows; the attention (varlen flash-attn on GPU, packed SDPA on
CPU: actors/packed_attention.py) attends within each sequence. Padded: one row per sequence.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlsys.records import TrainSequence

if TYPE_CHECKING:
    from rlsys.actors.cp_layout import ContextParallelLayout
    from rlsys.multimodal.vision_inputs import VisionInputs


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    # [B, T]; a vision-language model's: its multimodal rotary positions (rlsys/multimodal/positions.py),
    # [3, B, T] padded, or [4, 1, T] packed with each sequence's text positions (restarting at 0) first,
    # which transformers' Qwen2.5-VL reads as the packing (modeling_qwen2_5_vl.py Qwen2_5_VLTextModel.forward).
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # [B, T] for padded rows; None when packed
    targets: torch.Tensor  # [B, T-1]
    response_mask: torch.Tensor  # [B, T-1] float: the tokens the loss counts (response tokens, loss mask 1)
    loss_weights: torch.Tensor  # [B, T-1]: each such token's weight in the mini-batch loss, 0 elsewhere
    advantages: torch.Tensor  # [B, T-1] per token
    engine_logprobs: torch.Tensor  # [B, T-1], 0 outside the response
    engine_mask: torch.Tensor  # [B, T-1] float: loss tokens that have an engine log-prob
    indices: list[int]  # positions of these sequences in the caller's list
    spans: list[tuple[int, int, int]]  # per sequence: (row, first, end) target positions
    # Filled by the trainer before its optimizer steps: log-probs of the weights that generated
    # the rollout, and of the frozen reference (when KL is on). [B, T-1]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    # Packed rows only: offsets of the sequences in the row, [0, l0, l0 + l1, ..., T] (int32, on
    # the device), and the longest length (a host int). Passed to the model as flash-attn's varlen
    # arguments, so transformers does not re-derive them from position_ids in every layer (a
    # nonzero() and a .max() each: host syncs on a GPU, again in every recomputed layer).
    cu_seq_lens: torch.Tensor | None = None
    max_length: int | None = None
    # rollout.routing_replay: the engine's experts per input token, [B, T, MoE layers, top_k], -1
    # where a token has none (actors/routing_replay.py); None: the model routes by itself.
    routes: torch.Tensor | None = None
    # Context parallelism (actors/context_parallel.py): this rank's zigzag share of a packed row. Its
    # per-token tensors are then [1, T] and aligned with the inputs (each token's own target), where
    # an unsplit batch's are [B, T-1] (position t predicts token t + 1; the last predicts nothing).
    context_parallel: ContextParallelLayout | None = None
    # A vision-language model's images, in the order of their tokens in the rows: their patches
    # [patches, patch dim] and patch grids [images, 3] (rlsys/multimodal/vision_inputs.py).
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    # [B, T] bool: the tokens the images' features replace, in the prompts only (a sampled image
    # token is text: actors/image_placement.py); None for a text model.
    image_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> float:
        return float(self.response_mask.sum())

    def model_inputs(self) -> dict:
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.context_parallel is not None:
            # Read by the CP attention function of every layer (transformers passes extra keywords on).
            inputs["context_parallel"] = self.context_parallel
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.pixel_values is not None:
            inputs.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        if self.cu_seq_lens is not None:
            # transformers' FlashAttentionKwargs; with all four given, `_flash_attention_forward`
            # (transformers/modeling_flash_attention_utils.py) takes its varlen branch as is.
            inputs.update(cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                          max_length_q=self.max_length, max_length_k=self.max_length)
        return inputs


    def head_targets(self) -> torch.Tensor:
        """[B, T]: the token each input position predicts (any id where nothing is predicted)."""
        if self.context_parallel is not None:
            return self.targets
        return torch.nn.functional.pad(self.targets, (0, 1))

    def scored(self, per_position: torch.Tensor) -> torch.Tensor:
        """Per-position outputs [B, T, ...] -> the positions the per-token tensors describe."""
        return per_position if self.context_parallel is not None else per_position[:, :-1]


def _check(seq: TrainSequence) -> None:
    if not 1 <= seq.prompt_len <= len(seq.token_ids):
        raise ValueError(f"a training sequence needs 1..{len(seq.token_ids)} prompt tokens (got {seq.prompt_len})")
    if seq.engine_logprobs and len(seq.engine_logprobs) != seq.response_len:
        raise ValueError(f"{len(seq.engine_logprobs)} engine log-probs for {seq.response_len} response tokens")
    if seq.loss_mask is not None and len(seq.loss_mask) != seq.response_len:
        raise ValueError(f"a loss mask of {len(seq.loss_mask)} values for {seq.response_len} response tokens")
    if seq.routes is not None and not (seq.routes.ndim == 3 and len(seq.routes) < len(seq.token_ids)):
        raise ValueError(f"routes of shape {seq.routes.shape} for {len(seq.token_ids)} tokens (want [tokens - 1 or "
                         "fewer, MoE layers, top_k])")


def _rows(sequences: list[TrainSequence], packed: bool) -> tuple[list[list[TrainSequence]], int]:
    """The sequences (each checked) as rows: one packed row, or one row each; and the rows' width."""
    for seq in sequences:
        _check(seq)
    if packed:
        return [list(sequences)], sum(len(s.token_ids) for s in sequences)
    return [[seq] for seq in sequences], max(len(s.token_ids) for s in sequences)


def _vision_tensors(sequences: list[TrainSequence], rows: list[list[TrainSequence]], width: int,
                    position_ids: np.ndarray, vision: VisionInputs, image_dummy: bool, packed: bool,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor]:
    """A vision-language batch's pixel values, image grids, 3-row positions and prompt image-token
    mask; `image_dummy`: the last sequence is the one-token dummy image of a batch without one."""
    encoded = [vision.encode(seq.images) for seq in sequences[:-1] if image_dummy] + [vision.dummy()] \
        if image_dummy else [vision.encode(seq.images) for seq in sequences]
    pixel_values = torch.cat([e.pixel_values for e in encoded]).to(device)
    image_grid_thw = torch.tensor([grid for e in encoded for grid in e.grids], dtype=torch.long, device=device)
    positions = _multimodal_positions(rows, width, position_ids, [e.grids for e in encoded], vision, packed)
    image_mask = torch.from_numpy(_prompt_image_tokens(rows, width, vision.image_token_id)).to(device)
    return pixel_values, image_grid_thw, positions, image_mask


def build_micro_batch(
    sequences: list[TrainSequence], indices: list[int], pad_id: int, device: torch.device, packed: bool,
    vision: VisionInputs | None = None,
) -> MicroBatch:
    """Lay sequences out packed (one row) or padded (one row each).

    An empty list gives a two-token dummy row with an all-zero mask: a rank with no data still
    joins FSDP's collectives. Sequences without a `loss_weight` weigh 1 per loss token.
    `vision`: a vision-language model's; the batch then carries its sequences' images and
    multimodal positions, and a batch without an image gets a one-token dummy one, outside every
    span and loss, so the vision tower's collectives run on every rank in every pass.
    """
    is_dummy = not sequences
    if is_dummy:
        sequences, indices = [TrainSequence(token_ids=[pad_id, pad_id], prompt_len=2, loss_weight=0.0)], []
    image_dummy = vision is not None and not any(seq.images for seq in sequences)
    if image_dummy:
        sequences = [*sequences, TrainSequence(token_ids=[vision.image_token_id], prompt_len=1, loss_weight=0.0)]
    rows, width = _rows(sequences, packed)
    input_ids, position_ids, attention_mask, per_token, spans = _laid_out(rows, width, pad_id)
    routes = _laid_out_routes(rows, width)
    if is_dummy:
        for name in ("mask", "weight", "engine_mask"):
            per_token[name][:] = 0.0
        spans = []
    elif image_dummy:
        spans = spans[:-1]
    input_ids = torch.from_numpy(input_ids)
    lengths = [len(s.token_ids) for s in sequences]
    # Not for a vision-language model: its forward passes every keyword on to the vision tower too,
    # whose attention has its own cu_seq_lens (transformers' Qwen2.5-VL get_image_features).
    cu_seq_lens = (torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
                   if packed and vision is None else None)
    pixel_values = image_grid_thw = image_mask = None
    if vision is not None:
        pixel_values, image_grid_thw, position_ids, image_mask = _vision_tensors(
            sequences, rows, width, position_ids, vision, image_dummy, packed, device)

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return MicroBatch(
        input_ids=input_ids.to(device),
        position_ids=tensor(position_ids),
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        image_mask=image_mask,
        attention_mask=None if packed else tensor(attention_mask),
        targets=input_ids[:, 1:].to(device),
        response_mask=tensor(per_token["mask"]),
        loss_weights=tensor(per_token["weight"]),
        advantages=tensor(per_token["adv"]),
        engine_logprobs=tensor(per_token["engine"]),
        engine_mask=tensor(per_token["engine_mask"]),
        indices=list(indices),
        spans=spans,
        cu_seq_lens=None if cu_seq_lens is None else cu_seq_lens.to(device),
        max_length=max(lengths) if cu_seq_lens is not None else None,
        routes=None if routes is None else tensor(routes),
    )


def _multimodal_positions(rows: list[list[TrainSequence]], width: int, text_positions: np.ndarray,
                          grids: list[list[tuple[int, int, int]]], vision: VisionInputs, packed: bool) -> np.ndarray:
    """A vision-language batch's positions: each sequence's three rotary rows where its tokens lie
    (0 over padding), under the text positions when packed ([4, 1, T]), else [3, B, T]."""
    from rlsys.multimodal.positions import multimodal_position_ids

    out = np.zeros((3, len(rows), width), dtype=np.int64)
    grids_of = iter(grids)  # one entry per sequence, in row order
    for row, row_sequences in enumerate(rows):
        offset = 0
        for seq in row_sequences:
            length = len(seq.token_ids)
            out[:, row, offset:offset + length] = multimodal_position_ids(
                seq.token_ids, next(grids_of), vision.image_token_id, vision.merge, seq.prompt_len).numpy()
            offset += length
    return np.concatenate([text_positions[None], out]) if packed else out


def _prompt_image_tokens(rows: list[list[TrainSequence]], width: int, image_token_id: int) -> np.ndarray:
    """[rows, width] bool: the image tokens of each sequence's prompt where they lie."""
    out = np.zeros((len(rows), width), dtype=bool)
    for row, row_sequences in enumerate(rows):
        offset = 0
        for seq in row_sequences:
            out[row, offset:offset + seq.prompt_len] = np.asarray(seq.token_ids[:seq.prompt_len]) == image_token_id
            offset += len(seq.token_ids)
    return out


def _laid_out_routes(rows: list[list[TrainSequence]], width: int) -> np.ndarray | None:
    """The sequences' engine routes where their tokens lie, [rows, width, layers, top_k]; -1 where a
    token has none (padding, a response's last token, a sequence without routes). None: no routes."""
    shapes = {seq.routes.shape[1:] for row in rows for seq in row if seq.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"sequences of one batch carry routes of different shapes {sorted(shapes)}")
    (layers, top_k), = shapes
    out = np.full((len(rows), width, layers, top_k), -1, dtype=np.int64)
    for row, row_sequences in enumerate(rows):
        offset = 0
        for seq in row_sequences:
            if seq.routes is not None:
                out[row, offset:offset + len(seq.routes)] = seq.routes
            offset += len(seq.token_ids)
    return out


def _laid_out(rows: list[list[TrainSequence]], width: int, pad_id: int):
    """The rows' sequences one after another in arrays `width` tokens wide: input ids, positions,
    attention mask, the per-token arrays of MicroBatch by short name, and each sequence's span."""
    # Filled as numpy arrays and handed to torch once: a few torch ops per sequence (slice
    # assignment, torch.tensor of a short list) cost microseconds each, which for hundreds of
    # short sequences was a third of a small model's training step.
    shape = (len(rows), width)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    attention_mask = np.zeros(shape, dtype=np.int64)
    per_token = {name: np.zeros((len(rows), width - 1), dtype=np.float32)
                 for name in ("mask", "weight", "adv", "engine", "engine_mask")}
    positions = np.arange(max(len(s.token_ids) for row in rows for s in row), dtype=np.int64)
    spans = []
    for row, row_sequences in enumerate(rows):
        offset = 0
        for seq in row_sequences:
            length = len(seq.token_ids)
            input_ids[row, offset:offset + length] = seq.token_ids
            position_ids[row, offset:offset + length] = positions[:length]
            attention_mask[row, offset:offset + length] = 1
            first, end = offset + seq.prompt_len - 1, offset + length - 1
            spans.append((row, first, end))
            loss_mask = per_token["mask"][row, first:end]
            loss_mask[:] = 1.0 if seq.loss_mask is None else seq.loss_mask
            per_token["weight"][row, first:end] = loss_mask * np.float32(
                1.0 if seq.loss_weight is None else seq.loss_weight)
            per_token["adv"][row, first:end] = seq.advantage
            if seq.engine_logprobs:
                per_token["engine"][row, first:end] = seq.engine_logprobs
                per_token["engine_mask"][row, first:end] = loss_mask
            offset += length
    return input_ids, position_ids, attention_mask, per_token, spans


def split_evenly(items: list, parts: int) -> list[list]:
    """`parts` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def split_by_token_budget(lengths: list[int], indices: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of `indices` whose total length stays within `max_tokens`.

    A sequence longer than the budget goes alone (it cannot be split)."""
    groups, current, used = [], [], 0
    for index in indices:
        length = lengths[index]
        if current and used + length > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        groups.append(current)
    return groups


def balanced_partition(costs: list[int], parts: int) -> list[list[int]]:
    """The indices of `costs` in `parts` groups whose cost sums are near equal (some may be empty).

    Karmarkar-Karp's largest differencing method for k parts: every item starts as a partial
    partition of its own (its cost in one subset, the other k - 1 empty); the two partial partitions
    with the largest spread (max subset sum - min) are merged, the heaviest subset of one joined to
    the lightest of the other and so on down, which cancels the two spreads against each other;
    until one partition is left. Deterministic: ties go to the earlier items. Each group's indices
    ascend, and the groups are ordered by their first index (empty ones last), so one part is
    `range(len(costs))` in order.
    """
    if parts < 1:
        raise ValueError(f"a partition needs at least one part (got {parts})")
    # Heap entries: (-spread, smallest item index inside, non-empty subsets as [sum, indices] by sum
    # descending; the partition's other subsets are empty). The index is unique among live entries,
    # so the heap never compares subsets.
    heap = [(-cost, index, [[cost, [index]]]) for index, cost in enumerate(costs)]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, first, heavy = heapq.heappop(heap)
        _, second, light = heapq.heappop(heap)
        merged = _merged(heavy, light, parts)
        spread = merged[0][0] - (merged[-1][0] if len(merged) == parts else 0)
        heapq.heappush(heap, (-spread, min(first, second), merged))
    groups = [sorted(indices) for _, indices in heap[0][2]] if heap else []
    groups += [[] for _ in range(parts - len(groups))]
    return sorted(groups, key=lambda group: group[0] if group else len(costs))


def _merged(heavy: list[list], light: list[list], parts: int) -> list[list]:
    """Subset i of the merge: `heavy`'s i-th heaviest joined to `light`'s i-th lightest (position
    parts - 1 - i; positions past a list's end are empty subsets), by sum descending. Only the
    positions where either side has a subset are visited: early merges of few items stay cheap."""
    merged = []
    both_from = max(len(heavy), parts - len(light))
    for i in itertools.chain(range(len(heavy)), range(both_from, parts)):
        j = parts - 1 - i
        if i < len(heavy) and j < len(light):
            merged.append([heavy[i][0] + light[j][0], _joined(heavy[i][1], light[j][1])])
        else:
            merged.append(heavy[i] if i < len(heavy) else light[j])
    merged.sort(key=lambda subset: -subset[0])  # stable: equal sums keep their order
    return merged


def _joined(a: list[int], b: list[int]) -> list[int]:
    """One list of both (the lists are the merge's own): the shorter added to the longer, so
    building the whole partition copies each index O(log n) times, not O(n)."""
    if len(a) < len(b):
        a, b = b, a
    a.extend(b)
    return a

"""Host memory in the memory plan: what a trainer rank holds on its host that the device plan
does not already count (`host_terms`; rank 0, the largest), which `plan_memory` sums per rank and
per node. Not counted: each process's own runtime, the engines' host memory."""

from __future__ import annotations

import math

from rlsys.config import RunConfig
from rlsys.model.shape import ModelShape

# Where each backup starts in a sleeping rank's host arena (actors/offload.py, ALIGNMENT).
HOST_ALIGNMENT = 64


def _rank_shard_bytes(shapes: tuple[tuple[int, ...], ...], ranks: int, element_bytes: int,
                      alignment: int = 1) -> int:
    """Rank 0's share of the tensors of `shapes` as FSDP2 lays them out (the largest: each dim 0
    padded to a multiple of the ranks, `_get_dim0_padded_size`), each rounded up to `alignment`."""
    def one(shape: tuple[int, ...]) -> int:
        nbytes = -(-(shape or (1,))[0] // ranks) * math.prod((shape or (1,))[1:]) * element_bytes
        return -(-nbytes // alignment) * alignment
    return sum(one(shape) for shape in shapes)


def host_terms(config: RunConfig, shape: ModelShape, on_gpu: bool) -> dict[str, int]:
    """Host memory a trainer rank holds that the device plan does not count (rank 0, the largest).

    sleep_arena: a colocated rank that sleeps on a GPU host copies every storage of its state into
    one page-locked arena kept across steps (actors/offload.py), each copy rounded up to 64 bytes:
    the fp32 parameter shards (FSDP's padded flat shards) and AdamW's two fp32 moments and its
    step (a 4-byte tensor per trained parameter, fused); no gradients (train_step ends with
    zero_grad(set_to_none=True)). On a CPU host the copies replace the state in the same memory.
    reference_shards: with KL (not LoRA) and the reference on the host (trainer.reference_placement,
    as the memory plan resolved it) its fp32 shards, which FSDP streams from the host, page-locked in
    place on GPU hosts at exactly their bytes (actors/parallelize.py). On CPU
    the weight-sync staging buffers are host memory too, but the device plan counts them there.
    LoRA: the adapters counted by their parameters (their tensors' padding and steps left out)."""
    ranks = config.trainer.num_ranks
    lora = config.model.lora is not None
    shapes = shape.param_shapes or ((shape.params,),)
    terms = {"sleep_arena": 0, "reference_shards": 0}
    if on_gpu and config.trainer.sleeps_between_steps(config.placement.mode == "colocated", on_gpu):
        params = _rank_shard_bytes(shapes, ranks, 4, HOST_ALIGNMENT)
        if lora:
            adapters = -(-4 * shape.adapter_params // ranks)
            terms["sleep_arena"] = params + 3 * adapters  # the adapters and their two moments
        else:
            terms["sleep_arena"] = 3 * params + len(shapes) * HOST_ALIGNMENT  # + the steps
    if ((config.algorithm.use_kl_loss or config.algorithm.kl_in_reward) and not lora
            and config.trainer.reference_placement != "device"):
        terms["reference_shards"] = _rank_shard_bytes(shapes, ranks, 4)
    return terms

"""The memory plan's GPU terms that take more than a line of arithmetic, each sized from the model's
shapes as the code that allocates it sizes it: what a decoder layer keeps for backward per token
(an estimate); backward's two transients, never at once, the output layer's [V, H] weight gradient
in fp32 (`logprob_head_backward_bytes`) and FSDP's fp32 reduce-scatter input of the largest group
with its unsharded gradients (`gradient_reduce_bytes`); the weight sync's staging buffers, each its
largest bucket, at least the largest tensor, one with `weight_sync.pipelined` off (`staging_bytes`);
and what an engine keeps outside SGLang's static pool, so through /release_memory_occupation: its
attention workspace and the caching allocator's blocks of its last forward
(`engine_unreleased_bytes`); a vision-language model's vision tower on a micro-batch's images
(`vision_terms`). Every process on a GPU also holds a CUDA context and NCCL buffers
(`CUDA_CONTEXT_BYTES`, `NCCL_BUFFER_BYTES`)."""

from __future__ import annotations

import math
from dataclasses import replace

from rlsys.model.shape import GiB, ModelShape
from rlsys.multimodal.image_load import ImageLoad

# Per process on a GPU and outside any tensor (torch.cuda.memory_allocated never shows them):
# the CUDA context (kernels loaded lazily, cuBLAS workspaces) and NCCL's communicator buffers.
# They vary with GPU, driver and topology, so these are the upper end of published figures
# (NVIDIA/nccl#964: 544-688 MB per communicator on 4 A100s; a trainer holds FSDP's group and
# the weight-sync ones, an engine its TP and weight-update groups).
CUDA_CONTEXT_BYTES = 512 * 2**20
NCCL_BUFFER_BYTES = GiB
# An engine's attention workspace: SGLang's flashinfer backend takes 512 MiB for Qwen2/Qwen3
# (SGLANG_FLASHINFER_WORKSPACE_SIZE, sglang/srt/layers/attention/flashinfer_backend.py; 384 MiB
# otherwise); the upper figure, whichever backend SGLang picks.
ENGINE_WORKSPACE_BYTES = 512 * 2**20


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int) -> int:
    """What a Qwen2/Llama decoder layer keeps for backward, per token: inputs of the two norms
    (their fp32 upcasts too), q/k/v and the attention output, o_proj's input, the residuals, and
    the MLP's gate, up, activation and product (estimate); in a mixture-of-experts layer those of
    each expert the token is routed to (`active_intermediate`)."""
    kv_dim = shape.kv_heads * shape.head_dim
    elements = 8 * shape.hidden + 2 * kv_dim + 4 * (shape.active_intermediate or shape.intermediate)
    return elements * compute_bytes + 2 * shape.hidden * 4


def vision_terms(shape: ModelShape, images: ImageLoad | None, tokens: int, compute_bytes: int, on_gpu: bool,
                 checkpointing: bool) -> dict[str, int]:
    """A vision-language model's vision tower on a micro-batch of `tokens` (no terms for a text
    model; 0 for a dataset without images): its blocks run on every patch of the micro-batch's images,
    at most `images.token_share` of its tokens times the patches merged into each. What a block
    keeps for backward per patch is a decoder layer's (`activation_bytes_per_token_layer` with the
    tower's widths; no grouped KV heads); with gradient checkpointing, each block's input and one
    block. Its attention on CPU (SDPA's math kernel) keeps each image's fp32 [heads, patches,
    patches] scores per block: at most the micro-batch's patches times the largest image's; on
    GPU SDPA's fused kernels keep nothing quadratic."""
    vision = shape.vision
    if vision is None:
        return {}
    if images is None:
        return {"vision_activations": 0, "vision_attention_scores": 0}
    patches = math.ceil(tokens * images.token_share) * vision.patches_per_token
    block = replace(shape, hidden=vision.hidden, kv_heads=vision.heads, head_dim=vision.hidden // vision.heads,
                    intermediate=vision.intermediate, active_intermediate=vision.intermediate)
    per_block = activation_bytes_per_token_layer(block, compute_bytes) * patches
    kept_blocks = 1 if checkpointing else vision.blocks
    activations = (vision.blocks * patches * vision.hidden * compute_bytes + per_block if checkpointing
                   else vision.blocks * per_block)
    scores = 0 if on_gpu else patches * min(images.max_patches, patches) * vision.heads * 4 * kept_blocks
    return {"vision_activations": activations, "vision_attention_scores": scores}


def logprob_head_backward_bytes(shape: ModelShape, weight_bytes: int) -> int:
    """The output layer's weight gradient in `_ChunkedTargetLogProbs.backward`
    (actors/chunked_logprobs.py): an fp32 [V, H] accumulator, and per chunk the [V, H] product
    `chunk_grad.T @ hidden` in the weight's dtype plus its fp32 copy (`.to(dtype)`, a no-op for an
    fp32 weight) until `+=`; at return, the accumulator's copy in the weight's dtype."""
    upcast = weight_bytes != 4
    per_chunk = weight_bytes + (4 if upcast else 0)
    at_return = weight_bytes if upcast else 0
    return shape.vocab * shape.hidden * (4 + max(per_chunk, at_return))


def _padded_numel(shapes: tuple[tuple[int, ...], ...], ranks: int) -> int:
    """Elements of a group's reduce-scatter input: each gradient's dim 0 padded to a multiple of
    the ranks (`_get_dim0_padded_size`, torch/distributed/fsdp/_fully_shard/_fsdp_common.py)."""
    return sum(-(-(shape or (1,))[0] // ranks) * ranks * math.prod((shape or (1,))[1:]) for shape in shapes)


def gradient_reduce_bytes(shape: ModelShape, ranks: int, grad_bytes: int) -> int:
    """FSDP2's `foreach_reduce` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) for one
    group: the unsharded gradients (compute dtype) are copied into a `reduce_scatter_input` of the
    group's padded size at `reduce_dtype` (fp32: parallelize.py's MixedPrecisionPolicy; a fp32
    model's own dtype) before they are freed, and `reduce_output` takes the shard (a new tensor
    when gradients accumulate over micro-batches). One group at a time: `post_backward` frees the
    previous input first (reduce_scatter_max_input_buffers is 1). The root group (embeddings,
    final norm, output layer) reduces last, so the output layer's gradient, from the first op of
    backward, waits through every layer's reduce."""
    def group(shapes: tuple[tuple[int, ...], ...], numel: int) -> int:
        padded = _padded_numel(shapes, ranks) if shapes else numel
        return numel * grad_bytes + padded * 4 + padded // ranks * 4

    output_layer_grad = shape.vocab * shape.hidden * grad_bytes
    return max(group(shape.root_shapes, shape.root_params),
               group(shape.layer_shapes, shape.layer_params) + output_layer_grad)


def staging_bytes(shape: ModelShape, bucket_bytes: int, dtype: str, pipelined: bool = True) -> int:
    """The weight-sync staging buffers as `sync_weights` sizes them (weight_sync/sync.py,
    `staging_buffer_bytes`): each its largest bucket, so at least the largest tensor in the
    engine's dtype, whatever `bucket_bytes` says; pipelined, two of them (buckets alternate between
    them). The colocated alignment (16 bytes a tensor) bounds the broadcast's (1)."""
    if not shape.param_shapes:
        return bucket_bytes
    import torch

    from rlsys.weight_sync.colocated import COLOCATED_ALIGNMENT
    from rlsys.weight_sync.sync import staging_buffer_bytes

    params = [(str(i), torch.empty(s, device="meta")) for i, s in enumerate(shape.param_shapes)]
    return staging_buffer_bytes(params, bucket_bytes, COLOCATED_ALIGNMENT, getattr(torch, dtype), pipelined)


def sglang_prefill_chunk(engine, gpu_memory: int) -> int:
    """Tokens of an engine's largest forward: --chunked-prefill-size from rollout.engine.extra_args,
    else SGLang's default for the GPU's memory (sglang/srt/arg_groups/memory_hook.py); chunking off
    (-1), a whole context."""
    args = list(engine.extra_args)
    for i, arg in enumerate(args):
        if arg == "--chunked-prefill-size" and i + 1 < len(args) or arg.startswith("--chunked-prefill-size="):
            size = int(arg.split("=", 1)[1] if "=" in arg else args[i + 1])
            return size if size > 0 else engine.context_length
    mib = gpu_memory / 2**20
    return next((tokens for limit, tokens in ((20 * 1024, 2048), (60 * 1024, 4096), (160 * 1024, 8192))
                 if mib < limit), 16384)


def engine_unreleased_bytes(shape: ModelShape, engine, gpu_memory: int, dtype_bytes: int) -> int:
    """What an engine keeps on its GPU through /release_memory_occupation, outside
    torch_memory_saver's regions (weights, KV cache, CUDA graphs): its attention workspace and the
    caching allocator's blocks of its largest forward, a prefill chunk through the MLP (residual
    and normed hidden states, gate_up's output and the activation; SGLang never empties its cache
    on a release). An estimate."""
    width = 2 * shape.hidden + 3 * (shape.active_intermediate or shape.intermediate) // engine.tp_size
    return ENGINE_WORKSPACE_BYTES + sglang_prefill_chunk(engine, gpu_memory) * width * dtype_bytes

"""The memory plan: what each GPU will hold, per phase of a step, before anything starts.

Read from the model's config.json (the model is built on the meta device: shapes only) and the run
config. Trainer terms are per rank (FSDP2 shards the fp32 master weights, gradients and AdamW's
two moments over `trainer.num_ranks`; one decoder layer at a time is all-gathered in the compute
dtype, plus the next one prefetched, while the root group — embeddings, final norm, output layer
— stays gathered through forward and backward; none of that when one fp32 rank trains the model
whole, `uses_fsdp`). Backward adds the larger of two transients: the output layer's [V, H]
weight gradient in fp32 (`logprob_head_backward`) and FSDP's fp32 reduce-scatter input of the
largest group with its unsharded gradients (`gradient_reduce`). The weight sync's two staging
buffers (one with `weight_sync.pipelined` off) are each their largest bucket, at least the largest
tensor; every process on a GPU also holds a CUDA context and NCCL buffers (two processes per GPU
colocated). Engine terms follow SGLang's sizing: its static pool is `mem_fraction_static` of the
GPU, the weights come out of it and the rest is KV cache (capped by `max_total_tokens`;
sglang/srt/model_executor/model_runner.py, profile_max_num_token). Outside that pool, and so kept
through /release_memory_occupation, an engine holds its attention workspace and the caching
allocator's blocks of its last forward (`engine_unreleased`); a disaggregated engine also
receives each broadcast bucket into a new flat tensor on its GPU (`engine_receive_bucket`).

Phases: colocated with sleeping trainers, a GPU holds the engine (weights + KV cache) while it
generates, the trainer (everything it trains with) while the engine's memory is released, and
the trainer's weights and optimizer plus the staging buffers and the engine's weights during the sync; its
peak is the largest phase. Colocated without sleep, everything at once. Disaggregated: trainer
GPUs and engine GPUs separately; the peak is the larger. On CPU the "GPU" is a process's host
memory. Activations are an estimate (what a Qwen2/Llama decoder layer saves for backward), the
rest is exact arithmetic.

Context parallelism (`trainer.context_parallel_size`, CP): a rank's micro-batch is its share of
each packed sequence (padded to 2 x CP, over CP), so activations and logits per rank divide by CP;
the CP attention adds its own terms (`context_parallel_terms`), and a config whose longest sequence
does not fit a rank even alone is refused, naming the smallest CP that fits (`plan_memory`).

Host memory, per trainer rank and per node, is what the device plan does not already count:
`host_terms`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlsys.actors.context_parallel import check_ulysses_heads, padded_length
from rlsys.actors.parallelize import uses_fsdp
from rlsys.actors.ring_attention import score_chunks
from rlsys.config import ConfigError, RunConfig, check_context_parallel
from rlsys.system.backend import engine_dtype

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
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
# Where each backup starts in a sleeping rank's host arena (actors/offload.py, ALIGNMENT).
HOST_ALIGNMENT = 64

# Which config fields shrink each term (the advice printed when a plan does not fit).
ADVICE = {
    "trainer_params": "raise trainer.num_ranks (shards the fp32 master weights)",
    "trainer_grads": "raise trainer.num_ranks",
    "optimizer_states": "raise trainer.num_ranks (AdamW's moments are sharded too)",
    "unsharded_layers": "use a GPU with more memory (one layer is always gathered)",
    "unsharded_root": "use a GPU with more memory (embeddings and output layer are gathered)",
    "activations": "set trainer.gradient_checkpointing=true or lower trainer.max_tokens_per_microbatch",
    "attention_scores": "install flash-attn with model.dtype=bfloat16, or lower trainer.max_tokens_per_microbatch",
    "logits_chunk": "lower trainer.logprob_chunk_tokens",
    "attention_saved": "set trainer.gradient_checkpointing=true or raise trainer.context_parallel_size (the CP "
                       "attention's fp32 output and log-sum-exp, per layer)",
    "attention_block": "raise trainer.context_parallel_size (style ring: the exact fp32 block's scores shrink with "
                       "the square of a rank's share of the longest sequence)",
    "ring_buffers": "raise trainer.context_parallel_size or lower trainer.max_tokens_per_microbatch (key/value chunks "
                    "and their fp32 gradients travelling around the ring)",
    "ulysses_buffers": "lower trainer.max_tokens_per_microbatch or use trainer.context_parallel_style=ring (the "
                       "all-to-all's copies of q, k and v)",
    "reference_model": "turn KL off (algorithm.use_kl_loss / kl_in_reward) or use more memory",
    "logprob_head_backward": "use a GPU with more memory (the output layer's [vocab, hidden] gradient in fp32)",
    "gradient_reduce": "raise trainer.num_ranks (FSDP's fp32 reduce-scatter input of the largest group)",
    "weight_sync_staging": "lower weight_sync.bucket_size_mb (each staging buffer holds at least the largest tensor), "
                           "or weight_sync.pipelined=false (one buffer instead of two)",
    "cuda_contexts": "use a GPU with more memory (one CUDA context per process on the GPU)",
    "nccl_buffers": "use a GPU with more memory (NCCL's buffers, per process on the GPU)",
    "engine_weights": "raise rollout.engine.tp_size (placement.mode=disaggregated) or use more memory",
    "engine_kv_cache": "lower rollout.engine.mem_fraction_static or rollout.engine.max_total_tokens",
    "engine_unreleased": "lower SGLang's --chunked-prefill-size (rollout.engine.extra_args) or use more memory",
    "engine_receive_bucket": "lower weight_sync.bucket_size_mb (a bucket is at least the largest tensor)",
}


@dataclass(frozen=True)
class ModelShape:
    params: int  # distinct parameters (tied weights once)
    layer_params: int  # the largest decoder layer's
    root_params: int  # everything outside the decoder layers
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # Shapes, for what is sized per tensor: FSDP pads each one's dim 0 to a multiple of the ranks,
    # and the weight-sync staging buffer holds at least the largest (named_parameters order).
    # The MLP width a token passes through: intermediate for a dense model; for a mixture of experts
    # its top-k routed experts' (and a shared expert's) widths added up.
    active_intermediate: int = 0
    # model.lora: the adapters' parameters (all layers; the largest layer's): the only ones that
    # train, so the only ones with gradients and AdamW moments.
    adapter_params: int = 0
    layer_adapter_params: int = 0
    param_shapes: tuple[tuple[int, ...], ...] = ()
    layer_shapes: tuple[tuple[int, ...], ...] = ()  # the largest decoder layer's
    root_shapes: tuple[tuple[int, ...], ...] = ()  # outside the decoder layers (embeddings, norm, lm_head)

    @classmethod
    def from_model_dir(cls, path: str | Path, lora=None) -> ModelShape:
        import torch
        from transformers import AutoModelForCausalLM

        from rlsys.actors.parallelize import decoder_layers
        from rlsys.run.assets import read_architecture

        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"model.path {path} has no config.json (the memory plan reads the model's shapes)")
        config = read_architecture(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        adapters: dict[int, int] = {}  # id(decoder layer) -> its adapters' parameters
        if lora is not None:
            from rlsys.run.assets import trained_model

            adapted = trained_model(Path(path), lora)
            for layer in decoder_layers(adapted):
                adapters[id(layer)] = sum(p.numel() for n, p in layer.named_parameters() if ".lora_" in n)
        params = sum(p.numel() for p in model.parameters())
        layers = decoder_layers(model)
        layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        largest = layers[layer_params.index(max(layer_params))]
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        heads = config.num_attention_heads
        return cls(
            params=params, layer_params=max(layer_params), root_params=params - sum(layer_params),
            hidden=config.hidden_size, intermediate=config.intermediate_size, layers=len(layers), heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
            active_intermediate=_active_intermediate(config),
            adapter_params=sum(adapters.values()), layer_adapter_params=max(adapters.values(), default=0),
            param_shapes=tuple(tuple(p.shape) for _, p in model.named_parameters()),
            layer_shapes=tuple(tuple(p.shape) for p in largest.parameters()),
            root_shapes=tuple(tuple(p.shape) for p in model.parameters() if id(p) not in in_layers),
        )


def _active_intermediate(config) -> int:
    routed = getattr(config, "num_experts_per_tok", None)
    expert_width = getattr(config, "moe_intermediate_size", None)
    if not (routed and expert_width):
        return config.intermediate_size
    return routed * expert_width + (getattr(config, "shared_expert_intermediate_size", None) or 0)


@dataclass
class MemoryPlan:
    fits: bool
    per_gpu_bytes: int
    gpu_memory_bytes: int
    terms: dict[str, int]  # name -> bytes on one GPU (engine_kv_cache: what SGLang will allocate)
    phases: dict[str, int]  # phase -> bytes on one GPU at that time
    kv_cache_tokens: int
    mode: str
    advice: str = ""
    notes: list[str] = field(default_factory=list)
    host_terms: dict[str, int] = field(default_factory=dict)  # name -> bytes of host memory per trainer rank
    host_per_rank_bytes: int = 0
    ranks_per_node: int = 1  # trainer ranks on the busiest node
    host_per_node_bytes: int = 0
    device: str = ""  # what was planned for, and where its memory figure came from (`rlsys plan`)
    # The terms a trainer rank's own allocations make of each trainer phase (no CUDA context, no
    # engine): what bench/gpu_proof.py holds against torch.cuda.max_memory_allocated.
    trainer_terms: dict[str, tuple[str, ...]] = field(default_factory=dict)
    longest_sequence: int = 0  # tokens of the longest sequence the engines can return (context_length)
    context_parallel_size: int = 1
    rank_tokens: int = 0  # a rank's tokens in its largest micro-batch
    # Set when the longest sequence does not fit a rank even alone: the smallest CP that fits (0: none does).
    smallest_context_parallel: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        unit = "GPU" if self.device.startswith("GPU") or not self.device else "process (CPU)"
        lines = [f"memory plan ({self.mode}), per {unit} of {self.gpu_memory_bytes / GiB:.1f} GiB"
                 + (f" ({self.device})" if self.device else "") + ":"]
        lines += [f"  {name:<22} {value / GiB:9.2f} GiB" for name, value in self.terms.items()]
        lines.append(f"  KV cache holds {self.kv_cache_tokens:,} tokens")
        share = rank_share(self.longest_sequence, self.context_parallel_size)
        lines.append(f"  micro-batch of {self.rank_tokens:,} tokens a rank; longest sequence {self.longest_sequence:,} "
                     f"tokens, {share:,} a rank at context_parallel_size={self.context_parallel_size}")
        if self.smallest_context_parallel is not None:
            lines.append("  smallest trainer.context_parallel_size that fits: "
                         + (str(self.smallest_context_parallel) if self.smallest_context_parallel else "none"))
        lines += [f"  phase {name:<16} {value / GiB:9.2f} GiB" for name, value in self.phases.items()]
        verdict = "fits" if self.fits else f"does NOT fit: {self.advice}"
        lines.append(f"  peak {self.per_gpu_bytes / GiB:.2f} GiB of {self.gpu_memory_bytes / GiB:.1f} GiB: {verdict}")
        lines.append("host memory beyond the devices', per trainer rank:")
        lines += [f"  {name:<22} {value / GiB:9.2f} GiB" for name, value in self.host_terms.items()]
        lines.append(f"  per rank {self.host_per_rank_bytes / GiB:.2f} GiB; per node {self.host_per_node_bytes / GiB:.2f} "
                     f"GiB ({self.ranks_per_node} trainer ranks; not counted: each process's own runtime, "
                     "the engines' host memory)")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int) -> int:
    """What a Qwen2/Llama decoder layer keeps for backward, per token: inputs of the two norms
    (their fp32 upcasts too), q/k/v and the attention output, o_proj's input, the residuals, and
    the MLP's gate, up, activation and product (estimate); in a mixture-of-experts layer those of
    each expert the token is routed to (`active_intermediate`)."""
    kv_dim = shape.kv_heads * shape.head_dim
    elements = 8 * shape.hidden + 2 * kv_dim + 4 * (shape.active_intermediate or shape.intermediate)
    return elements * compute_bytes + 2 * shape.hidden * 4


def rank_share(length: int, cp: int) -> int:
    """One sequence's tokens on each rank of its CP group (actors/trainer.py, `_micro_batches`): the
    whole with CP 1, else its length padded to a multiple of 2 x CP, over CP."""
    return length if cp == 1 else padded_length(length, cp) // cp


def rank_tokens(config: RunConfig, longest: int) -> int:
    """A rank's tokens in its largest micro-batch. Packed: the budget, or the longest sequence's
    share when that is more (a sequence over the budget goes alone: `split_by_token_budget`);
    padded: micro_batch_size rows of the longest."""
    t = config.trainer
    if not t.packing:
        return t.micro_batch_size * longest
    return max(t.max_tokens_per_microbatch, rank_share(longest, t.context_parallel_size))


def context_parallel_terms(shape: ModelShape, config: RunConfig, tokens: int, longest: int,
                           compute_bytes: int) -> dict[str, int]:
    """What the CP attention (actors/context_parallel.py, ring_attention.py) holds on a rank of
    `tokens` local tokens, beyond the activation estimate; all 0 without CP. T = tokens, Hq, Hkv, D.

    attention_saved: kept per layer for backward (one layer with checkpointing): the fp32 output and
    log-sum-exp, Hq x T x (D + 1) x 4; Ulysses also its head-split q, k, v, (Hq + 2 Hkv) x T x D.
    attention_block: one call of the exact block backward (the larger of the two) at its largest
    block, the longest sequence's queries against its own keys (ring: its share on this rank, both
    chunks; Ulysses: the whole padded sequence, Hq / CP heads), taken in pieces of h heads x r query
    rows whose fp32 scores fit SCORE_BUDGET_BYTES (`score_chunks`): 4 fp32 score-sized buffers of a
    piece (scores, p, dO v^T - delta, ds), the piece's fp32 q and dO rows and its heads' fp32 k, v,
    and the block's fp32 dq, dk, dv, delta (ring: plus its selected copies of dO, q, out, lse, k, v).
    ring_buffers (backward): this rank's key/values [2, Hkv, T, D] and the received ones, their fp32
    gradients travelling around the ring and the received ones, and the fp32 dq accumulator.
    ulysses_buffers: the all-to-all's send and receive buffers of q, k, v and their head-major copy,
    3 x (Hq + 2 Hkv) x T x D."""
    t = config.trainer
    cp, ulysses = t.context_parallel_size, t.context_parallel_style == "ulysses"
    terms = dict.fromkeys(("attention_saved", "attention_block", "ring_buffers", "ulysses_buffers"), 0)
    if cp == 1:
        return terms
    hq, hkv, d, c = shape.heads, shape.kv_heads, shape.head_dim, compute_bytes
    qkv = (hq + 2 * hkv) * tokens * d * c
    kept = 1 if t.gradient_checkpointing else shape.layers
    terms["attention_saved"] = kept * (hq * tokens * (d + 1) * 4 + (qkv if ulysses else 0))
    heads, kv_heads = (hq // cp, hkv // cp) if ulysses else (hq, hkv)
    block = padded_length(longest, cp) if ulysses else rank_share(longest, cp)
    h, rows = score_chunks(heads, heads // kv_heads, block, block)
    outputs = hq * tokens * (d + 1) * 4 + 2 * hkv * tokens * d * 4  # dq, delta; dk, dv
    selected = 0 if ulysses else hq * tokens * (2 * d * c + 4 * d + 4) + 2 * hkv * tokens * d * c
    piece = 2 * h * rows * d * 4 + 2 * h * block * d * 4 + 4 * 4 * h * rows * block
    terms["attention_block"] = outputs + selected + piece
    if ulysses:
        terms["ulysses_buffers"] = 3 * qkv
    else:
        terms["ring_buffers"] = 2 * 2 * hkv * tokens * d * (c + 4) + hq * tokens * d * 4
    return terms


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
    reference_shards: with KL (not LoRA) the reference's fp32 shards, which FSDP streams from the
    host, page-locked in place on GPU hosts at exactly their bytes (actors/parallelize.py). On CPU
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
    if (config.algorithm.use_kl_loss or config.algorithm.kl_in_reward) and not lora:
        terms["reference_shards"] = _rank_shard_bytes(shapes, ranks, 4)
    return terms


def _plan(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool, flash_attention: bool,
          gpus_per_node: int, longest: int) -> MemoryPlan:
    """The plan of `config` whose longest sequence is `longest` tokens."""
    t, ranks = config.trainer, config.trainer.num_ranks
    compute = DTYPE_BYTES[config.model.dtype]
    served = engine_dtype(on_gpu, config.model.dtype)  # bf16 on a GPU whatever model.dtype; the sync casts to it
    engine_bytes = DTYPE_BYTES[served]
    engine = config.rollout.engine
    colocated = config.placement.mode == "colocated"
    cp = t.context_parallel_size

    tokens = rank_tokens(config, longest)
    # Packed rows attend within each sequence (actors/packed_attention.py): at worst, full-length ones.
    sequence = min(tokens, longest)
    sequences = max(1, tokens // sequence) if t.packing else t.micro_batch_size
    per_layer = activation_bytes_per_token_layer(shape, compute) * tokens
    if t.gradient_checkpointing:  # layer inputs kept; one layer recomputed at a time
        activations = shape.layers * tokens * shape.hidden * compute + per_layer
    else:
        activations = shape.layers * per_layer
    # flash-attn: nothing quadratic. SDPA on GPU: packed rows take no mask (its fused kernels keep
    # nothing quadratic); a padded batch, a [seq, seq] boolean mask per row. SDPA on CPU (math
    # kernel): fp32 probabilities per head, kept per layer for backward. With CP neither runs: the
    # CP attention's own terms (`context_parallel_terms`).
    scores_layers = 1 if t.gradient_checkpointing else shape.layers
    if flash_attention or cp > 1:
        attention_scores = 0
    elif on_gpu:
        attention_scores = 0 if t.packing else sequences * sequence**2
    else:
        attention_scores = sequences * shape.heads * sequence**2 * 4 * scores_layers
    needs_reference = config.algorithm.use_kl_loss or config.algorithm.kl_in_reward
    gathers = uses_fsdp(ranks, config.model.dtype, trainable=True)
    lora = config.model.lora is not None
    # LoRA: the fp32 base stays sharded beside the adapters; only the adapters have gradients and
    # AdamW moments; the reference is the same model with the adapters off (no second model); the
    # frozen output layer computes no weight gradient; FSDP reduce-scatters the adapters' gradients.
    trained = shape.adapter_params if lora else shape.params
    # Processes per GPU: colocated, a trainer rank and an engine (TP) worker; else one.
    processes = 2 if colocated else 1
    terms = {
        "trainer_params": 4 * (shape.params + (shape.adapter_params if lora else 0)) // ranks,
        "trainer_grads": 4 * trained // ranks,
        "optimizer_states": 8 * trained // ranks,
        "unsharded_layers": 2 * (shape.layer_params + shape.layer_adapter_params) * compute if gathers else 0,
        "unsharded_root": shape.root_params * compute if gathers else 0,
        "activations": activations,
        "attention_scores": attention_scores,
        **context_parallel_terms(shape, config, tokens, longest, compute),
        "logits_chunk": 3 * max(t.logprob_chunk_tokens or tokens, 1) * shape.vocab * 4,
        # Its fp32 shards live on the host (CPUOffloadPolicy); on the device, what is gathered.
        "reference_model": (2 * shape.layer_params + shape.root_params) * compute if needs_reference and not lora
        else 0,
        # The two transients of backward, never at once (the phases take the larger): the output
        # layer's gradient first, FSDP's reduce-scatter of each group after.
        "logprob_head_backward": 0 if lora else logprob_head_backward_bytes(shape, compute),
        "gradient_reduce": (shape.layer_adapter_params * (compute + 4) + shape.layer_adapter_params * 4 // ranks
                            if lora else gradient_reduce_bytes(shape, ranks, compute)) if gathers else 0,
        "weight_sync_staging": staging_bytes(shape, int(config.weight_sync.bucket_size_mb * 2**20),
                                             served, config.weight_sync.pipelined),
        "engine_weights": shape.params * engine_bytes // engine.tp_size,
        "cuda_contexts": processes * CUDA_CONTEXT_BYTES if on_gpu else 0,
        "nccl_buffers": processes * NCCL_BUFFER_BYTES if on_gpu else 0,
    }
    terms["engine_unreleased"] = engine_unreleased_bytes(shape, engine, gpu_memory, engine_bytes) if on_gpu else 0
    # Disaggregated: SGLang receives each broadcast bucket into a new flat tensor on the engine's GPU
    # (FlattenedTensorBucket.empty, sglang/srt/weight_sync/tensor_bucket.py), one bucket at a time;
    # colocated, the engine reads the trainer's staging buffer through its IPC handle.
    terms["engine_receive_bucket"] = 0 if colocated else staging_bytes(
        shape, int(config.weight_sync.bucket_size_mb * 2**20), served, pipelined=False)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * engine_bytes // engine.tp_size
    kv_room = int(engine.mem_fraction_static * gpu_memory) - terms["engine_weights"]
    kv_tokens = max(0, min(engine.max_total_tokens, kv_room // max(kv_per_token, 1)))
    terms["engine_kv_cache"] = kv_tokens * kv_per_token

    # Backward's transients: the output layer's gradient first, then per layer its attention's
    # (CP) while FSDP reduce-scatters the layer before; the phases take the larger.
    head, layer = ("logprob_head_backward",), ("gradient_reduce", "attention_block", "ring_buffers", "ulysses_buffers")
    transient = head if terms[head[0]] >= sum(terms[name] for name in layer) else layer
    # Held by every process through every phase; colocated, the released engine's leftovers too.
    runtime = ("cuda_contexts", "nccl_buffers") + (("engine_unreleased",) if colocated else ())
    train = ("trainer_params", "trainer_grads", "optimizer_states", "unsharded_layers", "unsharded_root",
             "activations", "attention_scores", "attention_saved", "logits_chunk", "reference_model", *transient)
    sync = ("trainer_params", "optimizer_states", "unsharded_layers", "weight_sync_staging", "engine_weights")
    serving = ("engine_weights", "engine_kv_cache")
    if t.sleeps_between_steps(colocated, on_gpu):
        members = {"generate": serving + runtime, "train": train + runtime, "sync": sync + runtime}
    elif colocated:
        other = set(head + layer) - set(transient)
        members = {"all_at_once": tuple(name for name in terms if name not in other)}
    else:
        members = {"trainer_gpu": train + ("weight_sync_staging",) + runtime,
                   "engine_gpu": serving + ("engine_unreleased", "engine_receive_bucket") + runtime}
    phases = {name: sum(terms[k] for k in names) for name, names in members.items()}
    notes = []
    per_gpu = max(phases.values())
    fits = per_gpu <= gpu_memory and kv_room > 0
    advice = ""
    if kv_room <= 0:
        advice = (f"engine_weights {terms['engine_weights'] / GiB:.1f} GiB exceed rollout.engine.mem_fraction_static "
                  f"x GPU ({engine.mem_fraction_static} x {gpu_memory / GiB:.1f} GiB): {ADVICE['engine_weights']}")
    elif not fits:
        worst_phase = max(phases, key=phases.get)
        largest = max(members[worst_phase], key=lambda name: terms[name])
        advice = (f"{worst_phase} needs {phases[worst_phase] / GiB:.1f} GiB of {gpu_memory / GiB:.1f} GiB; "
                  f"largest term {largest} {terms[largest] / GiB:.1f} GiB: {ADVICE[largest]}")
    if kv_tokens and kv_tokens < config.rollout.max_new_tokens + 64:
        notes.append(f"the KV cache holds only {kv_tokens} tokens")
    host = host_terms(config, shape, on_gpu)
    ranks_per_node = min(ranks, gpus_per_node) if on_gpu else ranks
    return MemoryPlan(fits, per_gpu, gpu_memory, terms, phases, kv_tokens, config.placement.mode, advice, notes,
                      host_terms=host, host_per_rank_bytes=sum(host.values()), ranks_per_node=ranks_per_node,
                      host_per_node_bytes=ranks_per_node * sum(host.values()), longest_sequence=longest,
                      context_parallel_size=cp, rank_tokens=tokens,
                      trainer_terms={"train": train, "sync": tuple(n for n in sync if not n.startswith("engine"))})


def plan_memory(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool = True,
                flash_attention: bool = False, gpus_per_node: int = 8) -> MemoryPlan:
    """The plan (module docstring); `gpus_per_node`: how many trainer ranks a node holds at most,
    for the host figure per node (on CPU every rank is on one node).

    The longest sequence is rollout.engine.context_length tokens (a prompt of up to context_length -
    max_new_tokens and its response). When the plan does not fit, the same trainer with that
    sequence alone in a micro-batch does not either, and one with short sequences does, the longest
    sequence is what does not fit a rank: the advice says so and names the smallest
    `trainer.context_parallel_size` that fits (`smallest_context_parallel`; 0 when none does)."""
    t = config.trainer
    if t.context_parallel_size > 1 and t.context_parallel_style == "ulysses":
        try:
            check_ulysses_heads(shape.heads, shape.kv_heads, t.context_parallel_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    longest = config.rollout.engine.context_length

    def plan(cp: int = t.context_parallel_size, style: str = t.context_parallel_style, budget: int | None = None,
             sequence: int = longest) -> MemoryPlan:
        trainer = t.model_copy(update={"context_parallel_size": cp, "context_parallel_style": style,
                                       "max_tokens_per_microbatch": budget or t.max_tokens_per_microbatch})
        if budget and not t.packing:  # a padded micro-batch of one row
            trainer = trainer.model_copy(update={"micro_batch_size": 1})
        return _plan(config.model_copy(update={"trainer": trainer}), shape, gpu_memory, on_gpu, flash_attention,
                     gpus_per_node, sequence)

    result = plan()
    if result.fits:
        return result
    alone = plan(budget=rank_share(longest, t.context_parallel_size))
    if alone.fits or not plan(budget=16, sequence=1).fits:  # the budget, or not the sequence at all
        return result
    result.smallest_context_parallel, way = _smallest_context_parallel(config, shape, longest, plan)
    phase = max(alone.phases, key=alone.phases.get)
    largest = max(alone.terms, key=alone.terms.get)
    result.advice = (
        f"the longest sequence ({longest:,} tokens: rollout.engine.context_length, a prompt and up to "
        f"rollout.max_new_tokens={config.rollout.max_new_tokens:,}) does not fit a rank even alone: "
        f"{rank_share(longest, t.context_parallel_size):,} tokens a rank at trainer.context_parallel_size="
        f"{t.context_parallel_size}, {phase} needs {alone.phases[phase] / GiB:.1f} GiB of {gpu_memory / GiB:.1f} GiB "
        f"(largest term {largest} {alone.terms[largest] / GiB:.1f} GiB); " + way)
    return result


def _smallest_context_parallel(config: RunConfig, shape: ModelShape, longest: int, plan) -> tuple[int, str]:
    """The smallest CP (a divisor of num_ranks; for Ulysses one dividing both head counts; the
    config's style first, then ring) whose plan fits, else whose plan with the longest sequence alone
    in a micro-batch fits; and what to set. (0, why) when none fits."""
    t = config.trainer
    try:
        check_context_parallel(t.model_copy(update={"context_parallel_size": 2}), config.algorithm)
    except ValueError as error:
        return 0, f"context parallelism cannot split it: {error}"
    styles = dict.fromkeys([t.context_parallel_style, "ring"])
    for size in (size for size in range(1, t.num_ranks + 1) if t.num_ranks % size == 0):
        for style in styles if size > 1 else [t.context_parallel_style]:
            if (size, style) == (t.context_parallel_size, t.context_parallel_style) or style == "ulysses" and (
                    shape.heads % size or shape.kv_heads % size):
                continue
            named = f"trainer.context_parallel_size={size}" + (
                f" trainer.context_parallel_style={style}" if style != t.context_parallel_style and size > 1 else "")
            if plan(size, style).fits:
                return size, f"set {named}, the smallest that fits"
            share = rank_share(longest, size)
            if plan(size, style, budget=share).fits:
                return size, (f"set {named} with trainer.max_tokens_per_microbatch<={share:,} (its share of the "
                              "longest sequence), the smallest that fits")
    largest = plan(t.num_ranks, "ring", budget=rank_share(longest, t.num_ranks))
    return 0, (f"no trainer.context_parallel_size dividing trainer.num_ranks={t.num_ranks} fits it (ring at "
               f"{t.num_ranks}, the sequence alone: {largest.per_gpu_bytes / GiB:.1f} GiB): raise trainer.num_ranks, "
               "lower rollout.engine.context_length, or use GPUs with more memory")


def memory_plan(config: RunConfig, gpus_per_node: int = 8) -> MemoryPlan:
    """`rlsys plan`: the plan of `config` on the devices `plan_device` decides (the cluster's GPUs
    from a GPU-less head, not its RAM), with the host memory of nodes of `gpus_per_node` GPUs."""
    import os

    import psutil
    import torch

    from rlsys.run.plan_device import cluster_gpus_and_memory, plan_device
    from rlsys.system.backend import choose_attention, flash_attn_available
    from rlsys.system.model_source import resolve_model_paths

    config = resolve_model_paths(config)
    local_gpu = (int(torch.cuda.get_device_properties(0).total_memory)
                 if config.placement.device != "cpu" and torch.cuda.is_available() else None)
    address = config.placement.ray_address or os.environ.get("RAY_ADDRESS")
    on_gpu, memory, source = plan_device(config, local_gpu, int(psutil.virtual_memory().total),
                                         (lambda: cluster_gpus_and_memory(address)) if address else None)
    flash = choose_attention(on_gpu, config.model.dtype, on_gpu and flash_attn_available()) == "flash_attention_2"
    shape = ModelShape.from_model_dir(config.model.path, config.model.lora)
    plan = plan_memory(config, shape, memory, on_gpu, flash, gpus_per_node)
    plan.device = f"{'GPUs' if on_gpu else 'CPUs'}: {source}"
    return plan


def plan_for_devices(config: RunConfig, on_gpu: bool, device_memory: int, flash_attention: bool) -> MemoryPlan:
    """`rlsys train`'s plan: for the devices its placement got (on_gpu and their memory read on the
    nodes, rlsys/system/node_checks.py; placement.gpu_memory_gb when set), refusing a config that cannot
    fit (ConfigError naming the term to change)."""
    if config.placement.gpu_memory_gb is not None:
        device_memory = int(config.placement.gpu_memory_gb * GiB)
    plan = plan_memory(config, ModelShape.from_model_dir(config.model.path, config.model.lora), device_memory, on_gpu,
                       flash_attention)
    if not plan.fits:
        raise ConfigError(f"memory plan: {plan.advice} (rlsys plan CONFIG shows every term)")
    return plan


def print_plan(plan: MemoryPlan, as_json: bool) -> None:
    print(json.dumps(plan.as_dict()) if as_json else plan.table())

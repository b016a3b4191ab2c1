"""The memory plan: what each GPU will hold, per phase of a step, before anything starts.

Read from the model's shapes (rlsys/model/shape.py: config.json alone) and the run config.
Trainer terms are per rank (FSDP2 shards the fp32 master weights, gradients and AdamW's two moments
over `trainer.num_ranks`; one decoder layer at a time is all-gathered in the compute dtype, plus the
next one prefetched, while the root group — embeddings, final norm, output layer — stays gathered
through forward and backward; none of that when one fp32 rank trains the model whole, `uses_fsdp`).
Backward adds the larger of its transients, the weight sync its staging buffers, and every process
on a GPU a CUDA context and NCCL buffers (two processes per GPU colocated): each sized in
rlsys/plan/gpu_terms.py. Engine terms follow SGLang's sizing: its static pool is
`mem_fraction_static` of the GPU, the weights come out of it and the rest is KV cache (capped by
`max_total_tokens`; sglang/srt/model_executor/model_runner.py, profile_max_num_token); outside it an
engine keeps `engine_unreleased`, and a disaggregated one receives each broadcast bucket into a new
flat tensor on its GPU (`engine_receive_bucket`).

Phases: colocated with sleeping trainers, a GPU holds the engine (weights + KV cache) while it
generates, the trainer (everything it trains with) while the engine's memory is released, and
the trainer's weights and optimizer plus the staging buffers and the engine's weights during the sync; its
peak is the largest phase. Colocated without sleep, everything at once. Disaggregated: trainer
GPUs and engine GPUs separately; the peak is the larger. On CPU the "GPU" is a process's host
memory. Activations are an estimate (what a Qwen2/Llama decoder layer saves for backward), the
rest is exact arithmetic.

Context parallelism (CP): a rank's micro-batch is its share of each sequence, and the CP attention
adds its own terms (rlsys/plan/context_parallel_plan.py); a config whose longest sequence does not
fit a rank even alone is refused, naming the smallest CP that fits (`plan_memory`).

Host memory, per trainer rank and per node, is what the device plan does not already count
(rlsys/plan/host_memory.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from rlsys.actors.cp_layout import check_ulysses_heads
from rlsys.actors.parallelize import uses_fsdp
from rlsys.config import ConfigError, RunConfig
from rlsys.model.shape import GiB, ModelShape
from rlsys.multimodal.image_load import ImageLoad
from rlsys.plan.context_parallel_plan import context_parallel_terms, rank_share, rank_tokens, smallest_context_parallel
from rlsys.plan.gpu_terms import (
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFER_BYTES,
    activation_bytes_per_token_layer,
    engine_unreleased_bytes,
    gradient_reduce_bytes,
    logprob_head_backward_bytes,
    staging_bytes,
    vision_terms,
)
from rlsys.plan.host_memory import host_terms
from rlsys.system.backend import engine_dtype

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

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
    "vision_activations": "set trainer.gradient_checkpointing=true or lower trainer.max_tokens_per_microbatch (the "
                          "vision tower runs on every patch of a micro-batch's images; smaller images have fewer)",
    "vision_attention_scores": "lower trainer.max_tokens_per_microbatch or use smaller images (the vision attention's "
                               "fp32 scores per image, on CPU)",
    "attention_saved": "set trainer.gradient_checkpointing=true or raise trainer.context_parallel_size (the CP "
                       "attention's fp32 output and log-sum-exp, per layer)",
    "attention_block": "raise trainer.context_parallel_size (style ring: the exact fp32 block's scores shrink with "
                       "the square of a rank's share of the longest sequence)",
    "ring_buffers": "raise trainer.context_parallel_size or lower trainer.max_tokens_per_microbatch (key/value chunks "
                    "and their fp32 gradients travelling around the ring)",
    "ulysses_buffers": "lower trainer.max_tokens_per_microbatch or use trainer.context_parallel_style=ring (the "
                       "all-to-all's copies of q, k and v)",
    "reference_model": "turn KL off (algorithm.use_kl_loss / kl_in_reward) or use more memory",
    "reference_on_device": "set trainer.reference_placement=host (its fp32 shards then stay on the host and stream "
                           "to the device each forward) or raise trainer.num_ranks",
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
    # Where a KL term's reference model keeps its shards (trainer.reference_placement resolved): True on
    # the device, False on the host, None when the run has no reference model of its own.
    reference_on_device: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        unit = "GPU" if self.device.startswith("GPU") or not self.device else "process (CPU)"
        lines = [f"memory plan ({self.mode}), per {unit} of {self.gpu_memory_bytes / GiB:.1f} GiB"
                 + (f" ({self.device})" if self.device else "") + ":"]
        lines += [f"  {name:<23} {value / GiB:8.2f} GiB" for name, value in self.terms.items()]
        lines.append(f"  KV cache holds {self.kv_cache_tokens:,} tokens")
        share = rank_share(self.longest_sequence, self.context_parallel_size)
        lines.append(f"  micro-batch of {self.rank_tokens:,} tokens a rank; longest sequence {self.longest_sequence:,} "
                     f"tokens, {share:,} a rank at context_parallel_size={self.context_parallel_size}")
        if self.smallest_context_parallel is not None:
            lines.append("  smallest trainer.context_parallel_size that fits: "
                         + (str(self.smallest_context_parallel) if self.smallest_context_parallel else "none"))
        if self.reference_on_device is not None:
            lines.append(f"  reference model: fp32 shards on the {'device' if self.reference_on_device else 'host'}")
        lines += [f"  phase {name:<17} {value / GiB:8.2f} GiB" for name, value in self.phases.items()]
        verdict = "fits" if self.fits else f"does NOT fit: {self.advice}"
        lines.append(f"  peak {self.per_gpu_bytes / GiB:.2f} GiB of {self.gpu_memory_bytes / GiB:.1f} GiB: {verdict}")
        lines.append("host memory beyond the devices', per trainer rank:")
        lines += [f"  {name:<23} {value / GiB:8.2f} GiB" for name, value in self.host_terms.items()]
        lines.append(f"  per rank {self.host_per_rank_bytes / GiB:.2f} GiB; per node {self.host_per_node_bytes / GiB:.2f} "
                     f"GiB ({self.ranks_per_node} trainer ranks; not counted: each process's own runtime, "
                     "the engines' host memory)")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _plan(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool, flash_attention: bool,
          gpus_per_node: int, longest: int, images: ImageLoad | None) -> MemoryPlan:
    """The plan of `config` whose longest sequence is `longest` tokens."""
    t, ranks = config.trainer, config.trainer.num_ranks
    tokens = rank_tokens(config, longest)
    terms = {**_trainer_terms(config, shape, on_gpu, flash_attention, tokens, longest),
             **vision_terms(shape, images, tokens, DTYPE_BYTES[config.model.dtype], on_gpu,
                            t.gradient_checkpointing),
             **_engine_terms(config, shape, gpu_memory, on_gpu)}
    kv_room, kv_tokens = terms.pop("kv_room"), terms.pop("kv_tokens")
    members, train, sync = _phase_members(terms, config, on_gpu)
    phases = {name: sum(terms.get(k, 0) for k in names) for name, names in members.items()}  # (vision: VLMs)
    notes = []
    per_gpu = max(phases.values())
    fits = per_gpu <= gpu_memory and kv_room > 0
    advice = ""
    engine = config.rollout.engine
    if kv_room <= 0:
        advice = (f"engine_weights {terms['engine_weights'] / GiB:.1f} GiB exceed rollout.engine.mem_fraction_static "
                  f"x GPU ({engine.mem_fraction_static} x {gpu_memory / GiB:.1f} GiB): {ADVICE['engine_weights']}")
    elif not fits:
        worst_phase = max(phases, key=phases.get)
        largest = max(members[worst_phase], key=lambda name: terms.get(name, 0))
        advice = (f"{worst_phase} needs {phases[worst_phase] / GiB:.1f} GiB of {gpu_memory / GiB:.1f} GiB; "
                  f"largest term {largest} {terms[largest] / GiB:.1f} GiB: {ADVICE[largest]}")
    if kv_tokens and kv_tokens < config.rollout.max_new_tokens + 64:
        notes.append(f"the KV cache holds only {kv_tokens} tokens")
    if images is not None and shape.vision is not None:
        notes.append(f"images: up to {images.token_share:.0%} of a micro-batch's tokens are image tokens, the largest "
                     f"image {images.max_patches:,} patches (from the {images.images:,} images of the training prompts)")
    host = host_terms(config, shape, on_gpu)
    ranks_per_node = min(ranks, gpus_per_node) if on_gpu else ranks
    return MemoryPlan(fits, per_gpu, gpu_memory, terms, phases, kv_tokens, config.placement.mode, advice, notes,
                      host_terms=host, host_per_rank_bytes=sum(host.values()), ranks_per_node=ranks_per_node,
                      host_per_node_bytes=ranks_per_node * sum(host.values()), longest_sequence=longest,
                      context_parallel_size=t.context_parallel_size, rank_tokens=tokens,
                      trainer_terms={"train": train, "sync": tuple(n for n in sync if not n.startswith("engine"))})


def _trainer_terms(config: RunConfig, shape: ModelShape, on_gpu: bool, flash_attention: bool, tokens: int,
                   longest: int) -> dict[str, int]:
    """A trainer rank's terms (bytes) for `tokens` per micro-batch, the longest sequence `longest`."""
    t, ranks = config.trainer, config.trainer.num_ranks
    compute = DTYPE_BYTES[config.model.dtype]
    cp = t.context_parallel_size
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
    return {
        "trainer_params": 4 * (shape.params + (shape.adapter_params if lora else 0)) // ranks,
        "trainer_grads": 4 * trained // ranks,
        "optimizer_states": 8 * trained // ranks,
        "unsharded_layers": 2 * (shape.layer_params + shape.layer_adapter_params) * compute if gathers else 0,
        "unsharded_root": shape.root_params * compute if gathers else 0,
        "activations": activations,
        "attention_scores": attention_scores,
        **context_parallel_terms(shape, config, tokens, longest, compute),
        "logits_chunk": 3 * max(t.logprob_chunk_tokens or tokens, 1) * shape.vocab * 4,
        # What of it is gathered on the device (two layers and the root, in the compute dtype) while
        # it computes; its fp32 shards live on the host (CPUOffloadPolicy) or on the device
        # (trainer.reference_placement), where they stay through every phase: a sleep moves the
        # trained state only.
        "reference_model": (2 * shape.layer_params + shape.root_params) * compute if needs_reference and not lora
        else 0,
        "reference_on_device": 4 * shape.params // ranks
        if needs_reference and not lora and t.reference_placement == "device" else 0,
        # The two transients of backward, never at once (the phases take the larger): the output
        # layer's gradient first, FSDP's reduce-scatter of each group after.
        "logprob_head_backward": 0 if lora else logprob_head_backward_bytes(shape, compute),
        "gradient_reduce": (shape.layer_adapter_params * (compute + 4) + shape.layer_adapter_params * 4 // ranks
                            if lora else gradient_reduce_bytes(shape, ranks, compute)) if gathers else 0,
    }


def _engine_terms(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool) -> dict[str, int]:
    """The weight sync's and an engine's terms (bytes), and its KV cache's room and tokens."""
    served = engine_dtype(on_gpu, config.model.dtype)  # bf16 on a GPU whatever model.dtype; the sync casts to it
    engine_bytes = DTYPE_BYTES[served]
    engine = config.rollout.engine
    colocated = config.placement.mode == "colocated"
    processes = 2 if colocated else 1  # per GPU: colocated, a trainer rank and an engine (TP) worker; else one
    bucket_bytes = int(config.weight_sync.bucket_size_mb * 2**20)
    terms = {
        "weight_sync_staging": staging_bytes(shape, bucket_bytes, served, config.weight_sync.pipelined),
        "engine_weights": shape.params * engine_bytes // engine.tp_size,
        "cuda_contexts": processes * CUDA_CONTEXT_BYTES if on_gpu else 0,
        "nccl_buffers": processes * NCCL_BUFFER_BYTES if on_gpu else 0,
    }
    terms["engine_unreleased"] = engine_unreleased_bytes(shape, engine, gpu_memory, engine_bytes) if on_gpu else 0
    # Disaggregated: SGLang receives each broadcast bucket into a new flat tensor on the engine's GPU
    # (FlattenedTensorBucket.empty, sglang/srt/weight_sync/tensor_bucket.py), one bucket at a time;
    # colocated, the engine reads the trainer's staging buffer through its IPC handle.
    terms["engine_receive_bucket"] = 0 if colocated else staging_bytes(shape, bucket_bytes, served, pipelined=False)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * engine_bytes // engine.tp_size
    kv_room = int(engine.mem_fraction_static * gpu_memory) - terms["engine_weights"]
    kv_tokens = max(0, min(engine.max_total_tokens, kv_room // max(kv_per_token, 1)))
    terms["engine_kv_cache"] = kv_tokens * kv_per_token
    return {**terms, "kv_room": kv_room, "kv_tokens": kv_tokens}


def _phase_members(terms: dict[str, int], config: RunConfig, on_gpu: bool) -> tuple[dict, tuple, tuple]:
    """The terms held at once in each phase of a step (by name), and the training and sync phases'."""
    colocated = config.placement.mode == "colocated"
    # Backward's transients: the output layer's gradient first, then per layer its attention's
    # (CP) while FSDP reduce-scatters the layer before; the phases take the larger.
    head, layer = ("logprob_head_backward",), ("gradient_reduce", "attention_block", "ring_buffers", "ulysses_buffers")
    transient = head if terms[head[0]] >= sum(terms[name] for name in layer) else layer
    # Held by every process through every phase; colocated, the released engine's leftovers too.
    runtime = ("cuda_contexts", "nccl_buffers") + (("engine_unreleased",) if colocated else ())
    train = ("trainer_params", "trainer_grads", "optimizer_states", "unsharded_layers", "unsharded_root",
             "activations", "attention_scores", "attention_saved", "logits_chunk", "reference_model",
             "reference_on_device", "vision_activations", "vision_attention_scores", *transient)
    sync = ("trainer_params", "optimizer_states", "unsharded_layers", "reference_on_device", "weight_sync_staging",
            "engine_weights")
    serving = ("engine_weights", "engine_kv_cache")
    if config.trainer.sleeps_between_steps(colocated, on_gpu):
        members = {"generate": serving + ("reference_on_device",) + runtime, "train": train + runtime,
                   "sync": sync + runtime}
    elif colocated:
        other = set(head + layer) - set(transient)
        members = {"all_at_once": tuple(name for name in terms if name not in other)}
    else:
        members = {"trainer_gpu": train + ("weight_sync_staging",) + runtime,
                   "engine_gpu": serving + ("engine_unreleased", "engine_receive_bucket") + runtime}
    return members, train, sync


def plan_memory(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool = True,
                flash_attention: bool = False, gpus_per_node: int = 8, images: ImageLoad | None = None) -> MemoryPlan:
    """`_plan_memory` with trainer.reference_placement resolved: auto puts a KL term's reference on
    the device when the plan fits with it there (its forward then streams nothing from the host),
    else on the host; on CPUs auto is the host (both are host memory). The plan says which in
    `reference_on_device` (None: no reference model of its own)."""
    placement = config.trainer.reference_placement
    if placement != "auto" or not _has_reference_model(config):
        return _plan_memory(config, shape, gpu_memory, on_gpu, flash_attention, gpus_per_node, images)

    def placed(where: str) -> MemoryPlan:
        trainer = config.trainer.model_copy(update={"reference_placement": where})
        return _plan_memory(config.model_copy(update={"trainer": trainer}), shape, gpu_memory, on_gpu,
                            flash_attention, gpus_per_node, images)

    if on_gpu:
        on_device = placed("device")
        if on_device.fits:
            on_device.notes.append("the reference model's fp32 shards are on the device (trainer.reference_placement "
                                   "auto: the plan fits with them there)")
            return on_device
    on_host = placed("host")
    if on_gpu:
        on_host.notes.append(f"the reference model's fp32 shards stay on the host: on the device the peak would be "
                             f"{on_device.per_gpu_bytes / GiB:.1f} GiB of {gpu_memory / GiB:.1f} GiB "
                             "(trainer.reference_placement auto)")
    return on_host


def _has_reference_model(config: RunConfig) -> bool:
    """A KL term's frozen reference model of its own (LoRA's is the policy with its adapters off)."""
    return (config.algorithm.use_kl_loss or config.algorithm.kl_in_reward) and config.model.lora is None


def _reference_on_device(config: RunConfig) -> bool | None:
    return config.trainer.reference_placement == "device" if _has_reference_model(config) else None


def _plan_memory(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool = True,
                 flash_attention: bool = False, gpus_per_node: int = 8, images: ImageLoad | None = None) -> MemoryPlan:
    """The plan (module docstring); `gpus_per_node`: how many trainer ranks a node holds at most,
    for the host figure per node (on CPU every rank is on one node); `images`: what the training
    prompts' images can take of a micro-batch (a vision-language model's; None: no vision terms).

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
                     gpus_per_node, sequence, images)

    result = plan()
    result.reference_on_device = _reference_on_device(config)
    if result.fits:
        return result
    alone = plan(budget=rank_share(longest, t.context_parallel_size))
    if alone.fits or not plan(budget=16, sequence=1).fits:  # the budget, or not the sequence at all
        return result
    result.smallest_context_parallel, way = smallest_context_parallel(config, shape, longest, plan)
    phase = max(alone.phases, key=alone.phases.get)
    largest = max(alone.terms, key=alone.terms.get)
    result.advice = (
        f"the longest sequence ({longest:,} tokens: rollout.engine.context_length, a prompt and up to "
        f"rollout.max_new_tokens={config.rollout.max_new_tokens:,}) does not fit a rank even alone: "
        f"{rank_share(longest, t.context_parallel_size):,} tokens a rank at trainer.context_parallel_size="
        f"{t.context_parallel_size}, {phase} needs {alone.phases[phase] / GiB:.1f} GiB of {gpu_memory / GiB:.1f} GiB "
        f"(largest term {largest} {alone.terms[largest] / GiB:.1f} GiB); " + way)
    return result


def memory_plan(config: RunConfig, gpus_per_node: int = 8, images: ImageLoad | None = None) -> MemoryPlan:
    """`rlsys plan`: the plan of `config` on the devices `plan_device` decides (the cluster's GPUs
    from a GPU-less head, not its RAM), with the host memory of nodes of `gpus_per_node` GPUs;
    `images`: the training prompts' image load (`rlsys plan` reads the data of a config with images)."""
    import os

    import psutil
    import torch

    from rlsys.plan.plan_device import cluster_gpus_and_memory, plan_device
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
    plan = plan_memory(config, shape, memory, on_gpu, flash, gpus_per_node, images)
    plan.device = f"{'GPUs' if on_gpu else 'CPUs'}: {source}"
    return plan


def plan_for_devices(config: RunConfig, shape: ModelShape, on_gpu: bool, device_memory: int,
                     flash_attention: bool, images: ImageLoad | None = None) -> MemoryPlan:
    """`rlsys train`'s plan: for the model's shapes and the devices its placement got (on_gpu and
    their memory read on the nodes, rlsys/system/node_checks.py; placement.gpu_memory_gb when set),
    refusing a config that cannot fit (ConfigError naming the term to change)."""
    if config.placement.gpu_memory_gb is not None:
        device_memory = int(config.placement.gpu_memory_gb * GiB)
    plan = plan_memory(config, shape, device_memory, on_gpu, flash_attention, images=images)
    if not plan.fits:
        raise ConfigError(f"memory plan: {plan.advice} (rlsys plan CONFIG shows every term)")
    return plan


def print_plan(plan: MemoryPlan, as_json: bool) -> None:
    print(json.dumps(plan.as_dict()) if as_json else plan.table())

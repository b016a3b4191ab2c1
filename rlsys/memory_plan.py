"""The memory plan: what each GPU will hold, per phase of a step, before anything starts.

Read from the model's config.json (the model is built on the meta device: shapes only) and the run
config. Trainer terms are per rank (FSDP2 shards the fp32 master weights, gradients and AdamW's
two moments over `trainer.num_ranks`; one decoder layer at a time is all-gathered in the compute
dtype, plus the next one prefetched, while the root group — embeddings, final norm, output layer
— stays gathered through forward and backward; none of that when one fp32 rank trains the model
whole, `uses_fsdp`). Engine terms follow SGLang's sizing: its static
pool is `mem_fraction_static` of the GPU, the weights come out of it and the rest is KV cache
(capped by `max_total_tokens`; sglang/srt/model_executor/model_runner.py, profile_max_num_token).

Phases: colocated with sleeping trainers, a GPU holds the engine (weights + KV cache) while it
generates, the trainer (everything it trains with) while the engine's memory is released, and
the trainer's weights and optimizer plus a bucket and the engine's weights during the sync; its
peak is the largest phase. Colocated without sleep, everything at once. Disaggregated: trainer
GPUs and engine GPUs separately; the peak is the larger. On CPU the "GPU" is a process's host
memory. Activations are an estimate (what a Qwen2/Llama decoder layer saves for backward), the
rest is exact arithmetic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlsys.actors.parallelize import uses_fsdp
from rlsys.config import ConfigError, RunConfig

GiB = 2**30
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
    "reference_model": "turn KL off (algorithm.use_kl_loss / kl_in_reward) or use more memory",
    "weight_sync_bucket": "lower weight_sync.bucket_size_mb",
    "engine_weights": "raise rollout.engine.tp_size (placement.mode=disaggregated) or use more memory",
    "engine_kv_cache": "lower rollout.engine.mem_fraction_static or rollout.engine.max_total_tokens",
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

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from rlsys.actors.parallelize import decoder_layers

        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"model.path {path} has no config.json (the memory plan reads the model's shapes)")
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        layers = decoder_layers(model)
        layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        heads = config.num_attention_heads
        return cls(
            params=params, layer_params=max(layer_params), root_params=params - sum(layer_params),
            hidden=config.hidden_size, intermediate=config.intermediate_size, layers=len(layers), heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
        )


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

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"memory plan ({self.mode}), per GPU of {self.gpu_memory_bytes / GiB:.1f} GiB:"]
        lines += [f"  {name:<20} {value / GiB:9.2f} GiB" for name, value in self.terms.items()]
        lines.append(f"  KV cache holds {self.kv_cache_tokens:,} tokens")
        lines += [f"  phase {name:<14} {value / GiB:9.2f} GiB" for name, value in self.phases.items()]
        verdict = "fits" if self.fits else f"does NOT fit: {self.advice}"
        lines.append(f"  peak {self.per_gpu_bytes / GiB:.2f} GiB of {self.gpu_memory_bytes / GiB:.1f} GiB: {verdict}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def device_memory_bytes(config: RunConfig) -> int:
    """`rlsys plan`'s budget on this machine: placement.gpu_memory_gb, else the detected GPU's
    memory, else (CPU runs) the host's RAM. (`rlsys train` plans for the devices its placement
    got instead: `plan_for_devices`.)"""
    if config.placement.gpu_memory_gb is not None:
        return int(config.placement.gpu_memory_gb * GiB)
    import torch

    if torch.cuda.is_available() and config.placement.device != "cpu":
        return int(torch.cuda.get_device_properties(0).total_memory)
    if config.placement.device == "cuda":
        raise ConfigError("placement.device is cuda but this machine has no GPU to read the memory of: set "
                          "placement.gpu_memory_gb to plan for the cluster's GPUs")
    import psutil

    return int(psutil.virtual_memory().total)


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int) -> int:
    """What a Qwen2/Llama decoder layer keeps for backward, per token: inputs of the two norms
    (their fp32 upcasts too), q/k/v and the attention output, o_proj's input, the residuals, and
    the MLP's gate, up, activation and product (estimate)."""
    kv_dim = shape.kv_heads * shape.head_dim
    elements = 8 * shape.hidden + 2 * kv_dim + 4 * shape.intermediate
    return elements * compute_bytes + 2 * shape.hidden * 4


def plan_memory(config: RunConfig, shape: ModelShape, gpu_memory: int, on_gpu: bool = True,
                flash_attention: bool = False) -> MemoryPlan:
    t, ranks = config.trainer, config.trainer.num_ranks
    compute = DTYPE_BYTES[config.model.dtype]
    engine_dtype = DTYPE_BYTES[config.model.dtype]
    engine = config.rollout.engine
    colocated = config.placement.mode == "colocated"

    tokens = t.max_tokens_per_microbatch if t.packing else t.micro_batch_size * engine.context_length
    # Packed rows attend within each sequence (actors/packed_attention.py): at worst, full-length ones.
    sequence = min(tokens, engine.context_length)
    sequences = max(1, tokens // sequence) if t.packing else t.micro_batch_size
    per_layer = activation_bytes_per_token_layer(shape, compute) * tokens
    if t.gradient_checkpointing:  # layer inputs kept; one layer recomputed at a time
        activations = shape.layers * tokens * shape.hidden * compute + per_layer
    else:
        activations = shape.layers * per_layer
    # flash-attn: nothing quadratic. SDPA on GPU: packed rows take no mask (its fused kernels keep
    # nothing quadratic); a padded batch, a [seq, seq] boolean mask per row. SDPA on CPU (math
    # kernel): fp32 probabilities per head, kept per layer for backward.
    scores_layers = 1 if t.gradient_checkpointing else shape.layers
    if flash_attention:
        attention_scores = 0
    elif on_gpu:
        attention_scores = 0 if t.packing else sequences * sequence**2
    else:
        attention_scores = sequences * shape.heads * sequence**2 * 4 * scores_layers
    needs_reference = config.algorithm.use_kl_loss or config.algorithm.kl_in_reward
    gathers = uses_fsdp(ranks, config.model.dtype, trainable=True)
    terms = {
        "trainer_params": 4 * shape.params // ranks,
        "trainer_grads": 4 * shape.params // ranks,
        "optimizer_states": 8 * shape.params // ranks,
        "unsharded_layers": 2 * shape.layer_params * compute if gathers else 0,
        "unsharded_root": shape.root_params * compute if gathers else 0,
        "activations": activations,
        "attention_scores": attention_scores,
        "logits_chunk": 3 * max(t.logprob_chunk_tokens or tokens, 1) * shape.vocab * 4,
        # Its fp32 shards live on the host (CPUOffloadPolicy); on the device, what is gathered.
        "reference_model": (2 * shape.layer_params + shape.root_params) * compute if needs_reference else 0,
        "weight_sync_bucket": int(config.weight_sync.bucket_size_mb * 2**20),
        "engine_weights": shape.params * engine_dtype // engine.tp_size,
    }
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * engine_dtype // engine.tp_size
    kv_room = int(engine.mem_fraction_static * gpu_memory) - terms["engine_weights"]
    kv_tokens = max(0, min(engine.max_total_tokens, kv_room // max(kv_per_token, 1)))
    terms["engine_kv_cache"] = kv_tokens * kv_per_token

    train = ("trainer_params", "trainer_grads", "optimizer_states", "unsharded_layers", "unsharded_root",
             "activations", "attention_scores", "logits_chunk", "reference_model")
    sync = ("trainer_params", "optimizer_states", "unsharded_layers", "weight_sync_bucket", "engine_weights")
    serving = ("engine_weights", "engine_kv_cache")
    if t.sleeps_between_steps(colocated, on_gpu):
        members = {"generate": serving, "train": train, "sync": sync}
    elif colocated:
        members = {"all_at_once": tuple(terms)}
    else:
        members = {"trainer_gpu": train + ("weight_sync_bucket",), "engine_gpu": serving}
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
    return MemoryPlan(fits, per_gpu, gpu_memory, terms, phases, kv_tokens, config.placement.mode, advice, notes)


def memory_plan(config: RunConfig) -> MemoryPlan:
    """`rlsys plan`: the plan of `config` on this machine's device (GPUs when the config asks for
    them or this machine has one)."""
    import torch

    from rlsys.weight_sync.backend import choose_attention, flash_attn_available

    on_gpu = config.placement.device == "cuda" or (config.placement.device == "auto" and torch.cuda.is_available())
    flash = choose_attention(on_gpu, config.model.dtype, on_gpu and flash_attn_available()) == "flash_attention_2"
    return plan_memory(config, ModelShape.from_model_dir(config.model.path), device_memory_bytes(config), on_gpu, flash)


def plan_for_devices(config: RunConfig, on_gpu: bool, device_memory: int, flash_attention: bool) -> MemoryPlan:
    """`rlsys train`'s plan: for the devices its placement got (on_gpu and their memory read on the
    nodes, rlsys/node_checks.py; placement.gpu_memory_gb when set), refusing a config that cannot
    fit (ConfigError naming the term to change)."""
    if config.placement.gpu_memory_gb is not None:
        device_memory = int(config.placement.gpu_memory_gb * GiB)
    plan = plan_memory(config, ModelShape.from_model_dir(config.model.path), device_memory, on_gpu, flash_attention)
    if not plan.fits:
        raise ConfigError(f"memory plan: {plan.advice} (rlsys plan CONFIG shows every term)")
    return plan


def print_plan(plan: MemoryPlan, as_json: bool) -> None:
    print(json.dumps(plan.as_dict()) if as_json else plan.table())

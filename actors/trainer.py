"""The FSDP2 trainer: one instance per rank, each inside a Ray actor (see actors/group.py).

Data parallel over the ranks' shares of the batch; parameters sharded with `fully_shard` per
decoder layer and then the root (a lone fp32 rank trains the model whole: `uses_fsdp`). Every
loss token carries its weight in the global mini-batch's loss (set by TrainerGroup from
algorithm.loss_agg_mode), so any split over ranks and micro-batches gives the same gradient.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from rlsys.actors.batching import MicroBatch, build_micro_batch, split_by_token_budget, split_evenly
from rlsys.actors.checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
from rlsys.actors.checkpoint_layout import checkpoint_pieces, released_names
from rlsys.actors.context_parallel import CONTEXT_PARALLEL, shard_micro_batch, unshard_values
from rlsys.actors.cp_layout import check_ulysses_heads, new_context_parallel_groups, padded_length
from rlsys.actors.image_placement import ImagePlacement
from rlsys.actors.loading import build_empty_model, fill_from_checkpoint, is_vision_parameter
from rlsys.actors.logprob_head import install_logprob_head
from rlsys.actors.lora import (
    adapters_disabled,
    add_adapters,
    checkpoint_name,
    initial_adapter,
    is_adapter_parameter,
    merged_parameters,
)
from rlsys.actors.offload import StateOffloader, trainer_state_tensors
from rlsys.actors.parallelize import parallelize, pin_host_shards, reshard, uses_fsdp
from rlsys.actors.profiling import RankProfiler, profiled_phase
from rlsys.actors.routing_replay import RouteReplay
from rlsys.actors.schedule import build_lr_scheduler
from rlsys.algorithms.grpo import kl_estimate, masked_sum
from rlsys.algorithms.losses import flagged_sequences, micro_batch_loss
from rlsys.algorithms.policy_losses import PolicyLoss
from rlsys.config import (
    AlgorithmConfig,
    ConfigError,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    check_context_parallel,
    resolve_derived_settings,
)
from rlsys.model.checks import model_report
from rlsys.model.shape import ModelShape
from rlsys.multimodal.vision_inputs import VisionInputs
from rlsys.records import TrainSequence
from rlsys.system.backend import engine_dtype, make_backend
from rlsys.system.node import bind_gloo_to_node_address, node_address
from rlsys.system.reaper import start_actor_reaper, stop_reaper
from rlsys.system.rendezvous import ReservedPort, rank_store
from rlsys.system.stacks import answer_stack_signal
from rlsys.system.topology import Topology
from rlsys.weight_sync.colocated import StagingBuffer
from rlsys.weight_sync.shared_staging import SharedStaging
from rlsys.weight_sync.sync import SyncPlan, WeightTransport, sync_weights
from rlsys.weight_sync.transports import connect_transport, shared_staging_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer rank's configuration: the run config's own sections, nothing copied. Its algorithm
    section is resolved (rlsys/config.py `resolve_derived_settings`); one given unresolved (a
    standalone group) takes the rollout section's defaults."""

    model: ModelConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    temperature: float = 1.0  # the rollout's: trainer log-probs are of the distribution it sampled
    seed: int = 0
    has_gpu: bool = False  # decided by the driver from the cluster's resources (rlsys/system/backend.py)
    # Processes of the run computing on a rank's node while it trains (Topology.cpu_sharers); the
    # rank's threads are its node's cores over this. None (standalone groups): one thread.
    cpu_sharers: int | None = None
    # rollout.routing_replay == "rollout": every forward routes by the engine's experts (actors/routing_replay.py)
    routing_replay: bool = False

    def __post_init__(self):
        if self.algorithm.loss_norm_tokens is None or self.algorithm.corrections is None:
            rollout = RolloutConfig()
            object.__setattr__(self, "algorithm", self.algorithm.resolved(rollout.max_new_tokens, off_policy=False))

    @classmethod
    def from_config(cls, config: RunConfig, has_gpu: bool, cpu_sharers: int | None = None) -> TrainerSpec:
        resolved = resolve_derived_settings(config)  # (a no-op for a loaded config: load_config resolved it)
        return cls(config.model, config.trainer, resolved.algorithm, config.rollout.temperature, seed=config.seed,
                   has_gpu=has_gpu, cpu_sharers=cpu_sharers, routing_replay=config.rollout.routing_replay == "rollout")

    def threads(self, node_cores: int) -> int:
        if self.trainer.threads_per_rank is not None:
            return self.trainer.threads_per_rank
        return max(1, node_cores // self.cpu_sharers) if self.cpu_sharers else 1

    @property
    def needs_reference(self) -> bool:
        return self.algorithm.use_kl_loss or self.algorithm.kl_in_reward

    @property
    def loss_norm_tokens(self) -> int:
        """The constant of seq-mean-token-sum-norm (algorithm.loss_norm_tokens, resolved)."""
        return self.algorithm.loss_norm_tokens

    @property
    def corrects(self) -> bool:
        """Whether the run has rollout corrections (algorithm.corrections, resolved)."""
        return bool(self.algorithm.corrections)


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
        for name, value in asdict(other).items():
            if name not in _EXTREMES:
                setattr(self, name, getattr(self, name) + value)
        self.rollout_ratio_min = min(self.rollout_ratio_min, other.rollout_ratio_min)
        self.rollout_ratio_max = max(self.rollout_ratio_max, other.rollout_ratio_max)
        return self

    def all_reduced(self, device) -> LossSums:
        sums = {name: value for name, value in asdict(self).items() if name not in _EXTREMES}
        values = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        # max(-min, max) in one collective
        extremes = torch.tensor([-self.rollout_ratio_min, self.rollout_ratio_max], dtype=torch.float64, device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        low, high = extremes.cpu().tolist()
        return LossSums(**dict(zip(sums, values.cpu().tolist(), strict=True)), rollout_ratio_min=-low,
                        rollout_ratio_max=high)

    def metrics(self, with_corrections: bool, policy_loss: PolicyLoss) -> dict[str, float]:
        """The loss per mini-batch; the rest per loss token (per engine-scored token for the
        engine/trainer mismatch and the importance weights, per sequence for seq_clip_fraction and
        masked_sequence_fraction), and the policy loss's own (`weight_metrics`)."""
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


def trained_parameters(lora: bool, freeze_vision: bool) -> Callable[[str], bool] | None:
    """Which parameters learn (None: all): LoRA's adapters only, and none of a frozen vision tower's."""
    if not lora and not freeze_vision:
        return None
    return lambda name: (not lora or is_adapter_parameter(name)) and not (freeze_vision and is_vision_parameter(name))


def _mismatch_sums(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, engine_mask: torch.Tensor) -> dict:
    """The engine/trainer mismatch of a micro-batch's engine-scored tokens, as LossSums' fields:
    rho = pi_old / pi_engine; k1 = log pi_engine - log pi_old and k3 = rho - log rho - 1, whose means
    estimate KL(engine || trainer) (verl's rollout_corr metrics); rho's sum, min and max."""
    if not engine_mask.any():
        return {}
    log_rho = (old_logprobs - engine_logprobs)[engine_mask > 0]
    rho = torch.exp(log_rho)
    return {"rollout_k1": (-log_rho).sum().item(), "rollout_k3": (rho - log_rho - 1.0).sum().item(),
            "rollout_ratio": rho.sum().item(), "rollout_ratio_min": rho.min().item(),
            "rollout_ratio_max": rho.max().item()}


class TrainerWorker:
    """One FSDP2 rank. Plain class: wrapped with `ray.remote` at the call site."""

    def __init__(self, spec: TrainerSpec, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        bind_gloo_to_node_address(node_address())  # its groups may span nodes (rlsys/system/node.py)
        self._reaper = start_actor_reaper()  # if this rank is killed: its staging buffer in this node's /dev/shm
        answer_stack_signal()  # its stacks on a hang where py-spy cannot read it (rlsys/system/stacks.py)
        self.holder: tuple[int, float] | None = None  # a warm rank's run's driver (`serve`)
        self._reset(spec)

    def _reset(self, spec: TrainerSpec) -> None:
        """Everything this rank holds for `spec` before `setup` builds its models: all of it is the
        spec's, so a rank reset with another spec (inspection.py's `rebuild`) is as a new one."""
        self.spec = spec
        self.backend = make_backend(spec.has_gpu, spec.model.dtype)
        torch.set_num_threads(spec.threads(len(os.sched_getaffinity(0))))
        torch.manual_seed(spec.seed)
        self.device = self.backend.device()
        self.model = None
        self.checkpoint_pieces: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        self.ref_model = None
        self.optimizer = None
        self.scheduler = None
        self.offloader = StateOffloader(pin_memory=self.backend.has_gpu)
        # Set by connect_engines: this rank's weight transport (None: it only joins the gathers).
        self.transport: WeightTransport | None = None
        self.gather_dst: int | None = None
        self.shared_staging: SharedStaging | None = None  # set by connect_engines
        self.gather_scratch = StagingBuffer(share_memory=False)  # ranks that only join all-gathers
        self.context_parallel = None  # this rank's CP group (setup), None without context parallelism
        self.profiler = RankProfiler(self.backend, self.rank)  # records only between start_profile and stop_profile
        self.reserved_port: ReservedPort | None = None  # rank 0's, from rendezvous_address until setup
        self.route_replays: dict[int, RouteReplay] = {}  # id(model) -> its routers' replay (routing_replay)
        # A vision-language model's image processor and token layout (setup; None for a text model)
        self.vision: VisionInputs | None = None
        self.released_name: Callable[[str], str] = str  # a parameter's name in the checkpoint and engines (setup)
        self.image_placements: dict[int, ImagePlacement] = {}  # id(model) -> where its image features go

    # ---- set-up -------------------------------------------------------------------------
    def node_address(self) -> str:
        return node_address()

    def process(self) -> tuple[int, str, str]:
        """(pid, Ray node id, node address): where this rank's stacks are read on a hang."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id(), node_address()

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the group meets (called on rank 0): a port this rank holds until `setup` serves the
        group's store on it, so no other process can take it in between (system/rendezvous.py)."""
        self.reserved_port = ReservedPort()
        return node_address(), self.reserved_port.port

    def model_report(self) -> tuple[ModelShape | None, str | None]:
        """(Before `setup`.) The model's shapes for the driver's memory plan, or why the ranks
        cannot load it (ConfigError's message): checked here, where the weights are read and where
        transformers' modeling code is imported anyway, instead of in the driver (rlsys/model/checks.py)."""
        try:
            return model_report(self.spec.model.path, self.spec.model.lora), None
        except ConfigError as error:
            return None, str(error)

    def setup(self, master_address: str, master_port: int) -> None:
        os.environ.setdefault("MASTER_ADDR", master_address)
        # torch's default for the backend, which its tcp:// rendezvous gave the store too (NCCL 10 min)
        timeout = (default_pg_nccl_timeout if self.backend.dist_backend == "nccl" else None) or default_pg_timeout
        store = rank_store(self.rank, master_address, master_port, self.world_size, timeout, self.reserved_port)
        self.reserved_port = None
        dist.init_process_group(backend=self.backend.dist_backend, store=store, rank=self.rank,
                                world_size=self.world_size)
        self._build()

    def _build(self) -> None:
        """This rank's context-parallel groups, models, optimizer and schedule for its spec. Collective."""
        t = self.spec.trainer
        check_context_parallel(t, self.spec.algorithm)  # a RunConfig checked it; a spec built directly too
        self.context_parallel = new_context_parallel_groups(self.world_size, self.rank, t.context_parallel_size,
                                                            t.context_parallel_style)
        rss_before = _resident_bytes()
        self.vision = VisionInputs.for_model(self.spec.model.path)
        self.model = self._build_model(trainable=True, lora=self.spec.model.lora is not None)
        # What the engine loads a stacked parameter (MoE experts) as: the sync sends those tensors.
        self.checkpoint_pieces = {name: [(piece.name, piece.shape) for piece in pieces]
                                  for name, pieces in checkpoint_pieces(self.model).items()}
        self.load_memory = {"rss_before_bytes": rss_before, "peak_rss_bytes": peak_resident_bytes(),
                            "model_bytes": sum(p.numel() * 4 for p in self.model.parameters())}
        # fused: one kernel over all parameters (CPU and CUDA) instead of a dozen ops per parameter,
        # each of which goes through DTensor's Python dispatch: 27 -> 24 ms of a 0.3M model's step.
        self.optimizer = torch.optim.AdamW(  # the adapters only, under LoRA
            [p for p in self.model.parameters() if p.requires_grad], lr=t.lr, betas=tuple(t.betas),
            weight_decay=t.weight_decay, eps=1e-8,
            fused=True,
        )
        self.scheduler = build_lr_scheduler(
            self.optimizer, t.lr_schedule, t.warmup_steps, t.total_steps * t.mini_batches_per_step, t.min_lr_ratio,
        )
        if self.spec.needs_reference and self.spec.model.lora is None:  # LoRA's reference: adapters off
            self.ref_model = self._build_model(trainable=False)
        if self.spec.routing_replay:
            self.route_replays = {id(model): RouteReplay(model) for model in (self.model, self.ref_model)
                                  if model is not None}
        if self.vision is not None:
            self.image_placements = {id(model): ImagePlacement(model) for model in (self.model, self.ref_model)
                                     if model is not None}

    def _build_model(self, trainable: bool, lora: bool = False) -> torch.nn.Module:
        """Built on the meta device, sharded, then each rank reads only its shards from the
        checkpoint (actors/loading.py): no rank ever holds the whole model, unless it trains alone
        in fp32 (`uses_fsdp`: then its shard is the whole model and FSDP has nothing to do).
        `lora`: with model.lora's adapters (actors/lora.py), the only parameters that train."""
        model = build_empty_model(self.spec.model.path, self._attention())
        # Checkpoint and engine names, read off the model before FSDP wraps it (actors/loading.py)
        self.released_name = released_names(model)
        if lora:
            settings = self.spec.model.lora
            add_adapters(model, settings.rank, settings.alpha, settings.dropout, settings.target_modules)
        install_logprob_head(model)  # before sharding: it keeps lm_head's parameter and FSDP group
        mesh = None
        if uses_fsdp(self.world_size, self.spec.model.dtype, trainable):
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.backend.device_type, (self.world_size,))
        model = parallelize(model, mesh, self.spec.model.dtype, trainable, self.spec.trainer.gradient_checkpointing,
                            trains=trained_parameters(lora, self.spec.model.freeze_vision))
        # The frozen reference stays on the host: FSDP streams it to the device layer by layer.
        seed = self.spec.seed
        fill_from_checkpoint(model, self.spec.model.path, self.device if trainable else "cpu", stored_as=checkpoint_name,
                             initial=(lambda name, shape: initial_adapter(name, shape, seed)
                                      if is_adapter_parameter(name) else None) if lora else None,
                             released=self.released_name)
        if not trainable:
            pin_host_shards(model, self.backend.has_gpu)  # in place, at exactly their bytes
        return model

    def _attention(self) -> str:
        """The attention implementation: the backend's, or with context parallelism the CP one."""
        if self.context_parallel is None:
            return self.backend.attn_implementation
        if self.context_parallel.style == "ulysses":
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.spec.model.path)
            check_ulysses_heads(config.num_attention_heads, config.num_key_value_heads, self.context_parallel.size)
        return CONTEXT_PARALLEL

    @contextmanager
    def _reference(self):
        """The reference policy of the KL terms: its own frozen model, or under LoRA the policy
        with its adapters off (the base model, no second copy)."""
        if self.ref_model is None and self.spec.model.lora is None:
            raise RuntimeError("no reference model: the run has no KL term (algorithm.use_kl_loss, kl_in_reward)")
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with adapters_disabled(self.model) as base:
                yield base

    # ---- micro-batches and log-probs ----------------------------------------------------
    @property
    def _pad_id(self) -> int:
        return getattr(self.model.config.get_text_config(), "pad_token_id", None) or 0

    def _global_max(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def _micro_batches(self, sequences: list[TrainSequence], indices: list[int]) -> list[MicroBatch]:
        """This rank's micro-batches for `indices`, padded with dummies to the ranks' maximum
        count so every rank runs the same number of FSDP forward/backward passes."""
        t, cp = self.spec.trainer, self.context_parallel
        if t.packing:
            # The budget is what one rank holds: with CP, a sequence's padded length over the group.
            lengths = [len(s.token_ids) if cp is None else padded_length(len(s.token_ids), cp.size) // cp.size
                       for s in sequences]
            groups = split_by_token_budget(lengths, indices, t.max_tokens_per_microbatch)
        else:
            groups = split_evenly(indices, max(1, math.ceil(len(indices) / t.micro_batch_size)))
        groups += [[] for _ in range(self._global_max(len(groups)) - len(groups))]
        batches = [build_micro_batch([sequences[i] for i in group], group, self._pad_id, self.device, t.packing,
                                     self.vision) for group in groups]
        if cp is not None:
            batches = [shard_micro_batch(batch, cp) for batch in batches]
        return batches

    def _forward(self, model, batch: MicroBatch, with_entropy: bool, temperature: float | None = None):
        """fp32 log-probs of the next tokens (and their distributions' entropy), [B, T-1] each, at
        `temperature` (None: the rollout's), computed by the output layer in chunks (actors/logprob_head.py)."""
        head = model.get_output_embeddings()
        if (replay := self.route_replays.get(id(model))) is not None:  # kept through a recomputing backward
            replay.set_routes(None if batch.routes is None else batch.routes.flatten(0, 1))
        temperature = self.spec.temperature if temperature is None else temperature
        placement = self.image_placements.get(id(model))
        with (head.computing(batch.head_targets(), temperature, with_entropy, self.spec.trainer.logprob_chunk_tokens),
              placement.placing(batch.image_mask) if placement is not None else nullcontext()):
            per_position = batch.scored(model(**batch.model_inputs()).logits)
        return per_position[..., 0], (per_position[..., 1] if with_entropy else None)

    @contextmanager
    def _forward_only(self, *models):
        """Around forwards that have no backward: every model leaves it resharded. FSDP2 keeps a
        root's parameters gathered after its forward for the backward (`parallelize.reshard`), so
        without this a log-prob pass would leave the embeddings and output layer gathered on the
        device through the engines' turn."""
        try:
            yield
        finally:
            for model in models:
                if model is not None:
                    reshard(model)

    @staticmethod
    def _per_sequence(batch: MicroBatch, values: torch.Tensor, into: list) -> None:
        if batch.context_parallel is not None:  # every CP rank's tokens, in the unsplit row (a collective)
            values = unshard_values(batch.context_parallel, values)
        for index, (row, first, end) in zip(batch.indices, batch.spans, strict=True):
            into[index] = values[row, first:end].tolist()

    @torch.no_grad()
    @profiled_phase("log_probs")
    def compute_log_probs(self, sequences: list[TrainSequence], reference: bool = False,
                          temperature: float | None = None) -> list[list[float]]:
        """Trainer log-probs of each sequence's response tokens (collective: all ranks call);
        `reference`: the KL terms' reference policy's instead of the policy's; `temperature`: of
        the distribution (None: the rollout's; the weight check's probes take the engine's score's)."""
        result: list[list[float]] = [[] for _ in sequences]
        with self._forward_only(self.model, self.ref_model):
            for batch in self._micro_batches(sequences, list(range(len(sequences)))):
                if reference:
                    with self._reference() as model:
                        logprobs, _ = self._forward(model, batch, with_entropy=False, temperature=temperature)
                else:
                    logprobs, _ = self._forward(self.model, batch, with_entropy=False, temperature=temperature)
                self._per_sequence(batch, logprobs, result)
        return result

    @torch.no_grad()
    def compute_sequence_kl(self, sequences: list[TrainSequence]) -> list[float]:
        """Sum over response tokens of the KL estimate to the reference (for KL in reward)."""
        if not self.spec.needs_reference:
            raise RuntimeError("compute_sequence_kl needs a reference model (algorithm.kl_in_reward)")
        per_token: list[list[float]] = [[] for _ in sequences]
        with self._forward_only(self.model, self.ref_model):
            for batch in self._micro_batches(sequences, list(range(len(sequences)))):
                logprobs, _ = self._forward(self.model, batch, with_entropy=False)
                with self._reference() as reference:
                    ref_logprobs, _ = self._forward(reference, batch, with_entropy=False)
                kl = kl_estimate(logprobs, ref_logprobs, self.spec.algorithm.kl_estimator)
                self._per_sequence(batch, kl, per_token)
        return [sum(values) for values in per_token]

    # ---- one training step --------------------------------------------------------------
    @torch.no_grad()
    def _attach_old_and_ref_logprobs(self, plan: list[list[MicroBatch]]) -> None:
        """Log-probs of the weights that generated the rollout (and of the reference). With one
        mini-batch the weights have not moved when its loss is taken, so the old log-probs are
        the current ones (ratio exactly 1): `_backward_mini_batch` takes them from its own forward
        and this pass is skipped."""
        policy_forwards = len(plan) > 1 or (self.spec.needs_reference and self.ref_model is None)
        with self._forward_only(self.model if policy_forwards else None, self.ref_model):
            for batches in plan:
                for batch in batches:
                    if len(plan) > 1:
                        batch.old_logprobs, _ = self._forward(self.model, batch, with_entropy=False)
                    if self.spec.needs_reference:
                        with self._reference() as reference:
                            batch.ref_logprobs, _ = self._forward(reference, batch, with_entropy=False)

    def _backward_mini_batch(self, batches: list[MicroBatch]) -> LossSums:
        """Accumulate the mini-batch's gradient; returns this rank's token sums."""
        algorithm = self.spec.algorithm
        sums = LossSums(mini_batches=1.0 if self.rank == 0 else 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            logprobs, entropy = self._forward(self.model, batch, with_entropy=True)
            # copied before the backward, whose recomputation (gradient checkpointing) routes again
            routing = replace(self.route_replays[id(self.model)].counts) if self.route_replays else None
            loss = micro_batch_loss(logprobs, entropy, batch, algorithm)
            # The weights hold the global mini-batch's normaliser; FSDP averages over ranks, hence world_size.
            (loss.objective * self.world_size).backward()
            with torch.no_grad():
                mask, tis = batch.response_mask, loss.tis
                sequences, clipped_sequences = (flagged_sequences(loss.clipped, mask, batch.spans)
                                                if algorithm.policy_loss.one_ratio_per_sequence else (0, 0))
                # per sequence only on whole rows: context parallelism allows token-level corrections only,
                # and its spans are the unsplit row's
                corrected_sequences, masked_sequences = (
                    flagged_sequences(loss.corrected.rejected, mask, batch.spans)
                    if algorithm.corrections and batch.context_parallel is None else (0, 0))
                sums += LossSums(
                    **_mismatch_sums(loss.old_logprobs, batch.engine_logprobs, batch.engine_mask),
                    masked_tokens=masked_sum(loss.corrected.rejected, mask).item(),
                    masked_sequences=masked_sequences,
                    corrected_sequences=corrected_sequences,
                    routed=routing.routed if routing else 0.0,
                    routed_differing=routing.differing if routing else 0.0,
                    objective=loss.objective.item(),
                    kl=masked_sum(loss.kl, mask).item(),
                    clipped=masked_sum(loss.clipped, mask).item(),
                    entropy=masked_sum(entropy, mask).item(),
                    logprob_mismatch=masked_sum((loss.old_logprobs - batch.engine_logprobs).abs(),
                                                batch.engine_mask).item(),
                    tis_weight=masked_sum(tis.weights, batch.engine_mask).item() if tis is not None else 0.0,
                    tis_clipped=masked_sum(tis.clipped, batch.engine_mask).item() if tis is not None else 0.0,
                    policy_weight=masked_sum(loss.weight, mask).item() if loss.weight is not None else 0.0,
                    sequences=sequences,
                    clipped_sequences=clipped_sequences,
                    tokens=mask.sum().item(),
                    engine_tokens=batch.engine_mask.sum().item(),
                )
        return sums

    def _plan(self, mini_batches: list[list[TrainSequence]]) -> list[list[MicroBatch]]:
        sequences = [seq for mini in mini_batches for seq in mini]
        plan, start = [], 0
        for mini in mini_batches:
            plan.append(self._micro_batches(sequences, list(range(start, start + len(mini)))))
            start += len(mini)
        return plan

    @profiled_phase("train_step")
    def train_step(self, mini_batches: list[list[TrainSequence]]) -> dict[str, float]:
        """Old/ref log-probs, then one optimizer step per mini-batch. Collective.

        `mini_batches` holds this rank's part of each global mini-batch (TrainerGroup splits the
        batch into mini-batches first and then over ranks, so any rank count sees the same
        mini-batches).
        """
        started = time.perf_counter()
        plan = self._plan(mini_batches)
        with self.profiler.phase("old_and_ref_logprobs"):
            self._attach_old_and_ref_logprobs(plan)
        sums, grad_norms = LossSums(), []
        for batches in plan:
            with self.profiler.phase("backward"):
                sums += self._backward_mini_batch(batches)
            with self.profiler.phase("optimizer"):
                grad_norms.append(self._optimizer_step())
        self.optimizer.zero_grad(set_to_none=True)  # no gradients held between steps
        return {
            **sums.all_reduced(self.device).metrics(with_corrections=self.spec.corrects,
                                                    policy_loss=self.spec.algorithm.policy_loss),
            "grad_norm": max(grad_norms),
            "nonfinite_grad_steps": float(sum(not math.isfinite(g) for g in grad_norms)),
            "lr": self.scheduler.get_last_lr()[0],
            "trainer_compute_s": time.perf_counter() - started,  # this rank's own seconds (time_train_s: the driver's)
        }

    def _optimizer_step(self) -> float:
        """Clip, then step (skipped when the gradient norm is not finite); the norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.trainer.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        norm = float(grad_norm)
        if not math.isfinite(norm):
            # Skip the update rather than poison the weights; the coordinator reports it.
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        self.optimizer.step()
        self.scheduler.step()
        return norm

    # ---- offload ------------------------------------------------------------------------
    def release_cached_memory(self) -> dict:
        """Return the caching allocator's free blocks to the device: after a train step they hold
        the step's activations, logits and gradients (tens of GiB at 14B), which the engine taking
        its weights back beside the awake trainer could not use otherwise. Parameters and
        optimizer state stay (the memory plan's sync phase counts them; a checkpoint may follow)."""
        self.backend.empty_device_cache()
        return {"held_bytes": self.backend.held_memory_bytes()}

    @profiled_phase("sleep")
    def sleep(self) -> dict:
        """Move parameters, gradients and optimizer state off the device, drop the weight-sync
        staging buffer (the next sync allocates it again), then return the freed blocks to the
        device (the caching allocator keeps them otherwise, and the colocated engine could not use
        them for its KV cache)."""
        report = self.offloader.sleep(trainer_state_tensors(self.model, self.optimizer))
        if self.transport is not None:
            self.transport.release_staging_buffer()
        if self.shared_staging is not None:  # the feeding rank's buffers, freed once no rank maps them
            self.shared_staging.release()
        self.gather_scratch.release()
        self.backend.empty_device_cache()
        report.held_bytes = self.backend.held_memory_bytes()
        return report.__dict__

    @profiled_phase("wake_up")
    def wake_up(self) -> dict:
        report = self.offloader.wake_up()
        report.held_bytes = self.backend.held_memory_bytes()
        return report.__dict__

    def host_memory_bytes(self) -> int:
        return _resident_bytes()

    # ---- checkpoints --------------------------------------------------------------------
    @profiled_phase("save_checkpoint")
    def save_checkpoint(self, directory: str) -> None:
        save_trainer_checkpoint(Path(directory), self.model, self.optimizer, self.scheduler, self.rank,
                                trained_only=self.spec.model.lora is not None)

    def load_checkpoint(self, directory: str) -> None:
        load_trainer_checkpoint(Path(directory), self.model, self.optimizer, self.scheduler, self.rank,
                                trained_only=self.spec.model.lora is not None)

    # ---- weights ------------------------------------------------------------------------
    def connect_engines(self, topology: Topology, timeout_s: float) -> None:
        """Set up this rank's weight transport as the topology says (weight_sync/transports.py).
        Collective (whether the ranks share staging buffers). Replaces any earlier transport."""
        self._close_transport()
        self.gather_dst = topology.gather_dst
        self.shared_staging = shared_staging_for(topology, self.world_size, self.backend)
        self.transport = connect_transport(topology, self.rank, self.backend, timeout_s)

    @profiled_phase("sync_weights")
    def sync_weights(self, bucket_bytes: int, weight_version: int, pipelined: bool = True) -> dict:
        """Gather the weights bucket by bucket and hand them to this rank's transport. Collective."""
        named, merge = self._engine_parameters()
        plan = SyncPlan(bucket_bytes, str(weight_version), pipelined=pipelined, gather_dst=self.gather_dst,
                        engine_dtype=getattr(torch, engine_dtype(self.spec.has_gpu, self.spec.model.dtype)),
                        pieces=self.checkpoint_pieces)
        return sync_weights(named, plan, self.transport, self.backend, self.gather_scratch, materialize=merge,
                            shared_staging=self.shared_staging).as_dict()

    def _engine_parameters(self) -> tuple[list[tuple[str, torch.Tensor]], Callable | None]:
        """What a sync sends, under the engine's names (the released checkpoint's: a vision-language
        model's `model.language_model.*` is `model.*` there), and how to materialize each (LoRA's
        merge). A frozen vision tower is left out: the engines loaded it and it never changes."""
        named, merge = (merged_parameters(self.model) if self.spec.model.lora is not None
                        else (list(self.model.named_parameters()), None))
        if self.spec.model.freeze_vision:
            named = [(name, param) for name, param in named if not is_vision_parameter(name)]
        released = self.released_name
        if released is str:
            return named, merge
        trainer_name = {released(name): name for name, _ in named}
        return ([(released(name), param) for name, param in named],
                None if merge is None else lambda name, tensor: merge(trainer_name[name], tensor))

    def _close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.shared_staging is not None:
            self.shared_staging.release()

    # ---- profiling (profile.steps) ------------------------------------------------------------
    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self, directory: str) -> list[str]:
        return self.profiler.stop(directory)

    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    def describe(self) -> dict:
        """What this rank runs on, as its backend decided (printed at start-up)."""
        sharded = any(hasattr(p, "device_mesh") for p in self.model.parameters())
        return {"device": str(self.device), "dist_backend": self.backend.dist_backend,
                "layout": "FSDP2" if sharded else "whole model",
                "attention": self.backend.attn_implementation, "compute_dtype": self.spec.model.dtype,
                "threads": torch.get_num_threads(),
                "context_parallel": (f"{self.context_parallel.style} over {self.context_parallel.size} ranks"
                                     if self.context_parallel is not None else "off")}

    def shutdown(self) -> None:
        self._close_transport()
        if dist.is_initialized():
            dist.destroy_process_group()
        stop_reaper(self._reaper)

    # ---- a warm rank: kept between runs by a standing set (actors/warm_ranks.py) ---------------
    def respec(self, spec: TrainerSpec) -> None:
        """Drop what this rank built for its last spec (models, optimizer, transport, seeded RNG) and
        take `spec`, whose models `build` makes: a new rank of the same process group but for the
        process, its imports (a rank's start is ~10 CPU-seconds of them) and the group it joined."""
        if spec.has_gpu != self.spec.has_gpu:
            raise ValueError("a rank takes a spec of its own device kind only")
        self._close_transport()
        self._reset(spec)  # drops the old models, optimizer and offloaded state with their references
        gc.collect()
        self.backend.empty_device_cache()

    def build(self) -> None:
        """The models, optimizer and schedule of the spec `respec` gave. Collective."""
        self._build()

    def keep_warm(self, identity: tuple) -> None:
        """Mark this rank as a standing set's warm rank, started as `identity` says (WarmIdentity)."""
        self.warm_identity = identity

    def started_as(self) -> tuple | None:
        return getattr(self, "warm_identity", None)

    def serve(self, driver_pid: int, driver_started: float, set_name: str | None = None) -> None:
        """The run whose driver is process `driver_pid` (its `start_key`: driver_started, on this node)
        holds this warm rank, which standing set `set_name` keeps: should the driver die without
        releasing it (killed), the rank releases itself, so its model and shared-memory staging do not
        outlive the run; and if the set is gone too (`rlsys engines down --force` leaves ranks in use to
        their run, which would stop them), nobody is left to stop the rank, so it exits. A driver on
        another node is not watched (`driver_pid` 0): the next run's `respec` drops what it left."""
        self.holder = (driver_pid, driver_started) if driver_pid else None
        self.kept_by = set_name
        if getattr(self, "_holder_watch", None) is None:
            self._holder_watch = threading.Thread(target=self._watch_holder, name="warm-rank-holder", daemon=True)
            self._holder_watch.start()

    def release(self) -> None:
        """The run is done with this warm rank: what it built is dropped; the process stays, idle."""
        self.holder = None
        self.respec(self.spec)

    def _watch_holder(self) -> None:
        import psutil
        import ray

        from rlsys.system.process_start import start_key

        while True:
            time.sleep(HOLDER_POLL_S)
            holder = getattr(self, "holder", None)
            if holder is None:
                continue
            try:
                alive = start_key(psutil.Process(holder[0])) == holder[1]
            except psutil.Error:
                alive = False
            if not alive and self.holder == holder:
                from rlsys.rollout.standing import set_stands

                self.holder = None
                # queued behind whatever the dead driver left running on this rank
                me = ray.get_runtime_context().current_actor
                me.release.remote()
                if self.kept_by is not None and not set_stands(self.kept_by):
                    me.leave.remote()

    def leave(self) -> None:
        """Ends this rank's process (a kept rank whose run and set are both gone: TrainerWorker.serve)."""
        import ray

        logger.info("trainer rank %d: its run's driver and its standing set are gone; exiting", self.rank)
        ray.actor.exit_actor()


# How often a warm rank looks for the driver that holds it (TrainerWorker.serve).
HOLDER_POLL_S = 1.0


def _resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_resident_bytes() -> int:
    """This process image's peak RSS: VmHWM, the high-water mark of its own address space. Not
    getrusage's ru_maxrss, which also counts the image before exec: a process forked from a large
    parent (a test runner holding 2 GB) reports at least the parent's RSS as its own peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, where /proc exists

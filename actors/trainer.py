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
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from rlsys.actors.batching import MicroBatch, build_micro_batch, split_by_token_budget, split_evenly
from rlsys.actors.checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
from rlsys.actors.context_parallel import shard_micro_batch, unshard_values
from rlsys.actors.cp_layout import new_context_parallel_groups, padded_length
from rlsys.actors.loss_sums import LossSums, mismatch_sums
from rlsys.actors.offload import StateOffloader, state_bytes_after_a_step, trainer_state_tensors
from rlsys.actors.parallelize import reshard
from rlsys.actors.profiling import RankProfiler, profiled_phase
from rlsys.actors.trainer_models import TrainerModels, build_trainer_models
from rlsys.actors.trainer_spec import TrainerSpec
from rlsys.actors.weights_out import WeightsOut
from rlsys.algorithms.grpo import kl_estimate, masked_sum
from rlsys.algorithms.losses import flagged_sequences, micro_batch_loss
from rlsys.config import (
    ConfigError,
    check_context_parallel,
)
from rlsys.model.checks import model_report
from rlsys.model.shape import ModelShape
from rlsys.records import TrainSequence
from rlsys.system.backend import engine_dtype, make_backend
from rlsys.system.node import bind_gloo_to_node_address, node_address
from rlsys.system.reaper import start_actor_reaper, stop_reaper
from rlsys.system.rendezvous import ReservedPort, rank_store
from rlsys.system.stacks import answer_stack_signal
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)


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
        self.models: TrainerModels | None = None  # built by setup (or build, after respec)
        self.load_memory: dict = {}
        self.offloader = StateOffloader(pin_memory=self.backend.has_gpu)
        self.weights_out = WeightsOut(self.backend)  # this rank's side of the weight sync (connect_engines)
        self.context_parallel = None  # this rank's CP group (setup), None without context parallelism
        self.profiler = RankProfiler(self.backend, self.rank)  # records only between start_profile and stop_profile
        self.reserved_port: ReservedPort | None = None  # rank 0's, from rendezvous_address until setup

    @property
    def model(self) -> torch.nn.Module | None:
        return self.models.model if self.models is not None else None

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self.models.ref_model if self.models is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.models.optimizer if self.models is not None else None

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

    def place_reference(self, on_device: bool) -> None:
        """(Before `setup` or `build`.) Where the KL term's reference keeps its shards, as the memory
        plan chose (trainer.reference_placement auto); nothing else of the spec changes, and rank 0
        keeps the port it reserved for the group's store."""
        self.spec = replace(self.spec, reference_on_device=on_device)

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
        self.models = build_trainer_models(self.spec, self.backend, self.world_size, self.context_parallel)
        self.load_memory = {"rss_before_bytes": rss_before, "peak_rss_bytes": peak_resident_bytes(),
                            "model_bytes": sum(p.numel() * 4 for p in self.model.parameters())}
        if self.spec.sleeps:  # the kept host arena of its sleeps, allocated and page-locked now
            self.load_memory["sleep_arena_s"] = self.offloader.prepare(
                state_bytes_after_a_step(self.model, self.optimizer))

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
                                     self.models.vision) for group in groups]
        if cp is not None:
            batches = [shard_micro_batch(batch, cp) for batch in batches]
        return batches

    def _forward(self, model, batch: MicroBatch, with_entropy: bool, temperature: float | None = None):
        """fp32 log-probs of the next tokens (and their distributions' entropy), [B, T-1] each, at
        `temperature` (None: the rollout's), computed by the output layer in chunks (actors/logprob_head.py)."""
        head = model.get_output_embeddings()
        if (replay := self.models.route_replays.get(id(model))) is not None:  # kept through a recomputing backward
            replay.set_routes(None if batch.routes is None else batch.routes.flatten(0, 1))
        temperature = self.spec.temperature if temperature is None else temperature
        placement = self.models.image_placements.get(id(model))
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
                    with self.models.reference() as model:
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
                with self.models.reference() as reference:
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
                        with self.models.reference() as reference:
                            batch.ref_logprobs, _ = self._forward(reference, batch, with_entropy=False)

    def _backward_mini_batch(self, batches: list[MicroBatch]) -> LossSums:
        """Accumulate the mini-batch's gradient; returns this rank's token sums."""
        algorithm = self.spec.algorithm
        sums = LossSums(mini_batches=1.0 if self.rank == 0 else 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            logprobs, entropy = self._forward(self.model, batch, with_entropy=True)
            # copied before the backward, whose recomputation (gradient checkpointing) routes again
            routing = replace(self.models.route_replays[id(self.model)].counts) if self.models.route_replays else None
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
                sums += LossSums(  # device tensors: read once, when the step's sums are all-reduced
                    **mismatch_sums(loss.old_logprobs, batch.engine_logprobs, batch.engine_mask),
                    masked_tokens=masked_sum(loss.corrected.rejected, mask),
                    masked_sequences=masked_sequences,
                    corrected_sequences=corrected_sequences,
                    routed=routing.routed if routing else 0.0,
                    routed_differing=routing.differing if routing else 0.0,
                    objective=loss.objective.detach(),
                    kl=masked_sum(loss.kl, mask),
                    clipped=masked_sum(loss.clipped, mask),
                    entropy=masked_sum(entropy, mask),
                    logprob_mismatch=masked_sum((loss.old_logprobs - batch.engine_logprobs).abs(), batch.engine_mask),
                    tis_weight=masked_sum(tis.weights, batch.engine_mask) if tis is not None else 0.0,
                    tis_clipped=masked_sum(tis.clipped, batch.engine_mask) if tis is not None else 0.0,
                    policy_weight=masked_sum(loss.weight, mask) if loss.weight is not None else 0.0,
                    sequences=sequences,
                    clipped_sequences=clipped_sequences,
                    tokens=mask.sum(),
                    engine_tokens=batch.engine_mask.sum(),
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
            "lr": self.models.scheduler.get_last_lr()[0],
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
        self.models.scheduler.step()
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
        self.weights_out.release_staging()
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
        save_trainer_checkpoint(Path(directory), self.model, self.optimizer, self.models.scheduler, self.rank,
                                trained_only=self.spec.model.lora is not None)

    def load_checkpoint(self, directory: str) -> None:
        load_trainer_checkpoint(Path(directory), self.model, self.optimizer, self.models.scheduler, self.rank,
                                trained_only=self.spec.model.lora is not None)

    # ---- weights ------------------------------------------------------------------------
    def connect_engines(self, topology: Topology, timeout_s: float) -> None:
        """Set up this rank's weight transport as the topology says (weight_sync/transports.py).
        Collective (whether the ranks share staging buffers). Replaces any earlier transport."""
        self.weights_out.connect(topology, self.rank, self.world_size, timeout_s)

    @profiled_phase("sync_weights")
    def sync_weights(self, bucket_bytes: int, weight_version: int, pipelined: bool = True) -> dict:
        """Gather the weights bucket by bucket and hand them to this rank's transport. Collective."""
        return self.weights_out.sync(self.models, self.spec.model.freeze_vision, bucket_bytes, weight_version,
                                     pipelined, getattr(torch, engine_dtype(self.spec.has_gpu, self.spec.model.dtype)))

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
                "reference": None if self.ref_model is None else ("device" if self.spec.reference_on_device
                                                                  else "host"),
                "context_parallel": (f"{self.context_parallel.style} over {self.context_parallel.size} ranks"
                                     if self.context_parallel is not None else "off")}

    def shutdown(self) -> None:
        self.weights_out.close()
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
        self.weights_out.close()
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

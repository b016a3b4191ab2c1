"""The FSDP2 trainer: one instance per rank, each inside a Ray actor (see actors/group.py).

Data parallel over the ranks' shares of the batch; parameters sharded with `fully_shard` per
decoder layer and then the root. The loss is normalised by the global number of response tokens
in the mini-batch, so any split over ranks and micro-batches gives the same gradient.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from actors.batching import MicroBatch, TrainSequence, build_micro_batch, split_by_token_budget, split_evenly
from actors.checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
from actors.offload import StateOffloader, trainer_state_tensors
from actors.schedule import build_lr_scheduler
from rlsys.algorithms.grpo import clipped_policy_loss, kl_estimate, masked_sum, token_entropy
from weight_sync.backend import detect_backend
from weight_sync.broadcast import BroadcastWeightSender, EngineEndpoint
from weight_sync.colocated import EngineWeightClient, StagingBuffer
from weight_sync.sync import sync_weights


@dataclass(frozen=True)
class TrainerSpec:
    model_path: str
    dtype: str = "float32"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    packing: bool = True
    max_tokens_per_microbatch: int = 4096  # packed micro-batches
    micro_batch_size: int = 64  # padded micro-batches (packing off)
    mini_batches_per_step: int = 1
    lr_schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_optimizer_steps: int = 1
    gradient_checkpointing: bool = False
    threads_per_rank: int = 1
    temperature: float = 1.0  # rollout temperature: logprobs are of the same distribution
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    use_kl_loss: bool = False
    kl_in_reward: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    seed: int = 0
    shard: bool = True  # False only for a single unsharded reference process (tests)
    force_cpu: bool = False

    @property
    def needs_reference(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        raise ValueError(f"cannot find decoder layers to shard in {type(model).__name__}")
    return layers


class TrainerWorker:
    """One FSDP2 rank. Plain class: wrapped with `ray.remote` at the call site."""

    def __init__(self, spec: TrainerSpec, rank: int, world_size: int):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.backend = detect_backend(force_cpu=spec.force_cpu)
        torch.set_num_threads(spec.threads_per_rank)
        torch.manual_seed(spec.seed)
        self.device = self.backend.device()
        self.model = None
        self.ref_model = None
        self.optimizer = None
        self.scheduler = None
        self.offloader = StateOffloader(pin_memory=self.backend.has_gpu)
        self.broadcast_sender: BroadcastWeightSender | None = None
        self.colocated_clients: dict[str, EngineWeightClient] = {}  # kept: they own staging buffers
        self.gather_scratch = StagingBuffer(share_memory=False)  # ranks that only join the gathers

    # ---- set-up -------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as sock:
            sock.bind(("", 0))
            return address, sock.getsockname()[1]

    def setup(self, master_address: str, master_port: int) -> None:
        os.environ.setdefault("MASTER_ADDR", master_address)
        dist.init_process_group(
            backend=self.backend.dist_backend,
            init_method=f"tcp://{master_address}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
        )
        self.model = self._build_model(trainable=True)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.spec.lr, betas=self.spec.betas,
            weight_decay=self.spec.weight_decay, eps=1e-8,
        )
        self.scheduler = build_lr_scheduler(
            self.optimizer, self.spec.lr_schedule, self.spec.warmup_steps,
            self.spec.total_optimizer_steps, self.spec.min_lr_ratio,
        )
        if self.spec.needs_reference:
            self.ref_model = self._build_model(trainable=False)

    def _build_model(self, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.spec.model_path, dtype=torch.float32,
            attn_implementation=self.backend.attn_implementation,
        )
        # The frozen reference lives on the host and streams to the device layer by layer.
        model = model.to(self.device if trainable or not self.spec.shard else "cpu")
        model.config.use_cache = False
        if trainable and self.spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.spec.shard:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.backend.device_type, (self.world_size,))
            kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy()}
            if self.spec.dtype == "bfloat16":
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if not trainable:
                # pin_memory needs an accelerator; on a CPU host the policy still runs unpinned.
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.backend.has_gpu)
            for layer in _decoder_layers(model):
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
        elif self.world_size != 1:
            raise ValueError("an unsharded trainer (shard=False) must run alone (world_size=1)")
        model.requires_grad_(trainable)
        model.train(trainable)
        return model

    # ---- micro-batches and log-probs ----------------------------------------------------
    @property
    def _pad_id(self) -> int:
        return self.model.config.pad_token_id or 0

    def _global_max(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def _global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu()

    def _micro_batches(self, sequences: list[TrainSequence], indices: list[int]) -> list[MicroBatch]:
        """This rank's micro-batches for `indices`, padded with dummies to the ranks' maximum
        count so every rank runs the same number of FSDP forward/backward passes."""
        if self.spec.packing:
            lengths = [len(s.token_ids) for s in sequences]
            groups = split_by_token_budget(lengths, indices, self.spec.max_tokens_per_microbatch)
        else:
            count = max(1, math.ceil(len(indices) / self.spec.micro_batch_size))
            groups = split_evenly(indices, count)
        groups += [[] for _ in range(self._global_max(len(groups)) - len(groups))]
        return [
            build_micro_batch([sequences[i] for i in group], group, self._pad_id, self.device, self.spec.packing)
            for group in groups
        ]

    def _forward(self, model, batch: MicroBatch, with_entropy: bool):
        logits = model(**batch.model_inputs()).logits
        logits = logits[:, :-1].float() / self.spec.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        entropy = token_entropy(logits) if with_entropy else None
        return logprobs, entropy

    @staticmethod
    def _per_sequence(batch: MicroBatch, values: torch.Tensor, into: list) -> None:
        for index, (row, first, end) in zip(batch.indices, batch.spans, strict=True):
            into[index] = values[row, first:end].tolist()

    @torch.no_grad()
    def compute_log_probs(self, sequences: list[TrainSequence]) -> list[list[float]]:
        """Trainer log-probs of each sequence's response tokens (collective: all ranks call)."""
        result: list[list[float]] = [[] for _ in sequences]
        for batch in self._micro_batches(sequences, list(range(len(sequences)))):
            logprobs, _ = self._forward(self.model, batch, with_entropy=False)
            self._per_sequence(batch, logprobs, result)
        return result

    @torch.no_grad()
    def compute_sequence_kl(self, sequences: list[TrainSequence]) -> list[float]:
        """Sum over response tokens of the KL estimate to the reference (for KL in reward)."""
        if self.ref_model is None:
            raise RuntimeError("compute_sequence_kl needs a reference model (algorithm.kl_in_reward)")
        per_token: list[list[float]] = [[] for _ in sequences]
        for batch in self._micro_batches(sequences, list(range(len(sequences)))):
            logprobs, _ = self._forward(self.model, batch, with_entropy=False)
            ref_logprobs, _ = self._forward(self.ref_model, batch, with_entropy=False)
            self._per_sequence(batch, kl_estimate(logprobs, ref_logprobs, self.spec.kl_estimator), per_token)
        return [sum(values) for values in per_token]

    # ---- one training step --------------------------------------------------------------
    @torch.no_grad()
    def _old_and_ref_logprobs(self, plan: list[list[MicroBatch]]) -> tuple[dict, dict]:
        """Log-probs of the weights that generated the rollout (and of the reference)."""
        old, ref = {}, {}
        for batches in plan:
            for batch in batches:
                old[id(batch)], _ = self._forward(self.model, batch, with_entropy=False)
                if self.ref_model is not None:
                    ref[id(batch)], _ = self._forward(self.ref_model, batch, with_entropy=False)
        return old, ref

    def _backward_mini_batch(self, batches: list[MicroBatch], old: dict, ref: dict) -> torch.Tensor:
        """Accumulate the mini-batch's gradient; returns token sums
        [loss, kl, clipped, entropy, |old - engine|, tokens, engine tokens]."""
        spec = self.spec
        mini_tokens = self._global_sum(torch.tensor([sum(b.num_tokens for b in batches)]))[0].item()
        normaliser = max(mini_tokens, 1.0)
        sums = torch.zeros(7, dtype=torch.float64)
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            logprobs, entropy = self._forward(self.model, batch, with_entropy=True)
            old_logprobs = old[id(batch)]
            terms = clipped_policy_loss(logprobs, old_logprobs, batch.advantages, spec.clip_eps_low, spec.clip_eps_high)
            token_loss = terms.loss
            kl = torch.zeros_like(logprobs)
            if self.ref_model is not None:
                kl = kl_estimate(logprobs, ref[id(batch)], spec.kl_estimator)
                if spec.use_kl_loss:
                    token_loss = token_loss + spec.kl_coef * kl
            if spec.entropy_coef:
                token_loss = token_loss - spec.entropy_coef * entropy
            mask = batch.response_mask
            # Normalised by the global token count; FSDP averages over ranks, hence world_size.
            loss = masked_sum(token_loss, mask) / normaliser * self.world_size
            loss.backward()
            with torch.no_grad():
                sums += torch.tensor([
                    masked_sum(token_loss, mask).item(),
                    masked_sum(kl, mask).item(),
                    masked_sum(terms.clipped, mask).item(),
                    masked_sum(entropy, mask).item(),
                    masked_sum((old_logprobs - batch.engine_logprobs).abs(), batch.engine_mask).item(),
                    mask.sum().item(),
                    batch.engine_mask.sum().item(),
                ], dtype=torch.float64)
        return sums

    def _plan(self, mini_batches: list[list[TrainSequence]]) -> tuple[list[TrainSequence], list[list[MicroBatch]]]:
        sequences = [seq for mini in mini_batches for seq in mini]
        plan, start = [], 0
        for mini in mini_batches:
            plan.append(self._micro_batches(sequences, list(range(start, start + len(mini)))))
            start += len(mini)
        return sequences, plan

    def train_step(self, mini_batches: list[list[TrainSequence]]) -> dict[str, float]:
        """Old/ref log-probs, then one optimizer step per mini-batch. Collective.

        `mini_batches` holds this rank's part of each global mini-batch (TrainerGroup splits the
        batch into mini-batches first and then over ranks, so any rank count sees the same
        mini-batches).
        """
        _, plan = self._plan(mini_batches)
        old, ref = self._old_and_ref_logprobs(plan)
        sums = torch.zeros(7, dtype=torch.float64)
        grad_norms = []
        for batches in plan:
            sums += self._backward_mini_batch(batches, old, ref)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(float(grad_norm))
            if not math.isfinite(grad_norms[-1]):
                # Skip the update rather than poison the weights; the coordinator reports it.
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradients held between steps

        total = self._global_sum(sums).tolist()
        tokens = max(total[5], 1.0)
        return {
            "loss": total[0] / tokens,
            "kl": total[1] / tokens,
            "clip_fraction": total[2] / tokens,
            "entropy": total[3] / tokens,
            "logprob_mismatch": total[4] / max(total[6], 1.0),
            "grad_norm": max(grad_norms),
            "nonfinite_grad_steps": float(sum(not math.isfinite(g) for g in grad_norms)),
            "train_tokens": total[5],
            "lr": self.scheduler.get_last_lr()[0],
        }

    def loss_gradients(self, sequences: list[TrainSequence]) -> dict[str, torch.Tensor]:
        """Full gradients of the step's loss on `sequences` as one mini-batch, no update (tests)."""
        from weight_sync.buckets import gather_full_tensor

        _, plan = self._plan([sequences])
        old, ref = self._old_and_ref_logprobs(plan)
        self._backward_mini_batch(plan[0], old, ref)
        grads = {name: gather_full_tensor(p.grad).cpu().clone() for name, p in self.model.named_parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    # ---- offload ------------------------------------------------------------------------
    def sleep(self) -> dict:
        """Move parameters, gradients and optimizer state off the device."""
        return self.offloader.sleep(trainer_state_tensors(self.model, self.optimizer)).__dict__

    def wake_up(self) -> dict:
        return self.offloader.wake_up().__dict__

    def host_memory_bytes(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    # ---- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        save_trainer_checkpoint(Path(directory), self.model, self.optimizer, self.scheduler, self.rank)

    def load_checkpoint(self, directory: str) -> None:
        load_trainer_checkpoint(Path(directory), self.model, self.optimizer, self.scheduler, self.rank)

    # ---- weights ------------------------------------------------------------------------
    def sync_weights(
        self, engine_url: str | None, engine_tp_size: int, bucket_bytes: int, weight_version: int,
        gather_dst: int | None = None,
    ) -> dict:
        """Colocated: push the weights to this rank's engine by IPC handle (or join the gathers).
        `gather_dst`: the only rank with an engine, if just one has one (see `sync_weights`)."""
        client = None
        if engine_url:
            client = self.colocated_clients.setdefault(engine_url, EngineWeightClient(engine_url, engine_tp_size))
        return sync_weights(self.model.named_parameters(), bucket_bytes, client, str(weight_version),
                            self.backend, self.gather_scratch, gather_dst).as_dict()

    def connect_broadcast(self, engines: list[tuple[str, int]], timeout_s: float) -> None:
        """Rank 0 only: form the weight-update group with every engine worker."""
        if self.rank != 0:
            raise RuntimeError("only trainer rank 0 joins the weight-update group")
        address, _ = self.rendezvous_address()
        self.broadcast_sender = BroadcastWeightSender(
            [EngineEndpoint(url, tp) for url, tp in engines], self.backend, address, timeout_s
        )
        self.broadcast_sender.connect()

    def sync_weights_broadcast(self, bucket_bytes: int, weight_version: int) -> dict:
        """Disaggregated: rank 0 broadcasts each gathered bucket; the other ranks join the gathers."""
        return sync_weights(self.model.named_parameters(), bucket_bytes, self.broadcast_sender,
                            str(weight_version), self.backend, self.gather_scratch, gather_dst=0).as_dict()

    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of every parameter (collective; for tests and export)."""
        from weight_sync.buckets import gather_full_tensor

        return {name: gather_full_tensor(p).cpu().clone() for name, p in self.model.named_parameters()}

    def shutdown(self) -> None:
        if self.broadcast_sender is not None:
            self.broadcast_sender.close()
            self.broadcast_sender = None
        for client in self.colocated_clients.values():
            client.close()
        self.colocated_clients = {}
        if dist.is_initialized():
            dist.destroy_process_group()

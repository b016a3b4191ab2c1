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

import torch
import torch.distributed as dist

from actors.batching import MicroBatch, TrainSequence, build_micro_batch, split_evenly
from rlsys.algorithms.grpo import clipped_policy_loss, kl_estimate, masked_sum, token_entropy
from weight_sync.backend import detect_backend
from weight_sync.colocated import EngineWeightClient
from weight_sync.sync import sync_weights_colocated

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainerSpec:
    model_path: str
    dtype: str = "float32"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    mini_batches_per_step: int = 1
    threads_per_rank: int = 1
    temperature: float = 1.0  # rollout temperature: logprobs are of the same distribution
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    seed: int = 0
    shard: bool = True  # False only for a single unsharded reference process (tests)
    force_cpu: bool = False


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
        if self.spec.use_kl_loss:
            self.ref_model = self._build_model(trainable=False)

    def _build_model(self, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.spec.model_path, dtype=torch.float32,
            attn_implementation=self.backend.attn_implementation,
        ).to(self.device)
        model.config.use_cache = False
        if self.spec.shard:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.backend.device_type, (self.world_size,))
            policy = MixedPrecisionPolicy()
            if self.spec.dtype == "bfloat16":
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
        elif self.world_size != 1:
            raise ValueError("an unsharded trainer (shard=False) must run alone (world_size=1)")
        model.requires_grad_(trainable)
        model.train(trainable)
        return model

    # ---- log-probs ----------------------------------------------------------------------
    def _forward(self, model, batch: MicroBatch, with_entropy: bool):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1].float() / self.spec.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        entropy = token_entropy(logits) if with_entropy else None
        return logprobs, entropy

    def _micro_batches(self, sequences: list[TrainSequence], indices: list[int], count: int):
        return [
            build_micro_batch([sequences[i] for i in chunk], chunk, self._pad_id, self.device)
            for chunk in split_evenly(indices, count)
        ]

    @property
    def _pad_id(self) -> int:
        return self.model.config.pad_token_id or 0

    def _global_max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    @torch.no_grad()
    def compute_log_probs(self, sequences: list[TrainSequence]) -> list[list[float]]:
        """Trainer log-probs of each sequence's response tokens (collective: all ranks call)."""
        count = self._global_max([max(1, math.ceil(len(sequences) / self.spec.micro_batch_size))])[0]
        result: list[list[float]] = [[] for _ in sequences]
        for batch in self._micro_batches(sequences, list(range(len(sequences))), count):
            logprobs, _ = self._forward(self.model, batch, with_entropy=False)
            for row, index in enumerate(batch.indices):
                seq = sequences[index]
                result[index] = logprobs[row, seq.prompt_len - 1:len(seq.token_ids) - 1].tolist()
        return result

    # ---- one training step --------------------------------------------------------------
    def train_step(self, mini_batches: list[list[TrainSequence]]) -> dict[str, float]:
        """Old/ref log-probs, then one optimizer step per mini-batch. Collective.

        `mini_batches` holds this rank's part of each global mini-batch (TrainerGroup splits the
        batch into mini-batches first and then over ranks, so any rank count sees the same
        mini-batches).
        """
        spec = self.spec
        sequences = [seq for mini in mini_batches for seq in mini]
        bounds = [0]
        for mini in mini_batches:
            bounds.append(bounds[-1] + len(mini))
        minis = [list(range(bounds[i], bounds[i + 1])) for i in range(len(mini_batches))]
        counts = self._global_max([max(1, math.ceil(len(m) / spec.micro_batch_size)) for m in minis])
        plan = [self._micro_batches(sequences, mini, count) for mini, count in zip(minis, counts, strict=True)]

        # Old log-probs (and reference log-probs) from the weights that generated the rollout.
        old, ref = {}, {}
        with torch.no_grad():
            for batches in plan:
                for batch in batches:
                    old[id(batch)], _ = self._forward(self.model, batch, with_entropy=False)
                    if self.ref_model is not None:
                        ref[id(batch)], _ = self._forward(self.ref_model, batch, with_entropy=False)

        # Sums over response tokens: loss, kl, clipped, entropy, mismatch, tokens, mismatch tokens.
        sums = torch.zeros(7, dtype=torch.float64)
        grad_norms = []
        for batches in plan:
            mini_tokens = self._global_sum(torch.tensor([sum(b.num_tokens for b in batches)]))[0].item()
            normaliser = max(mini_tokens, 1.0)
            self.optimizer.zero_grad(set_to_none=True)
            for batch in batches:
                logprobs, entropy = self._forward(self.model, batch, with_entropy=True)
                old_logprobs = old[id(batch)]
                terms = clipped_policy_loss(
                    logprobs, old_logprobs, batch.advantages, spec.clip_eps_low, spec.clip_eps_high
                )
                token_loss = terms.loss
                kl = torch.zeros_like(logprobs)
                if self.ref_model is not None:
                    kl = kl_estimate(logprobs, ref[id(batch)], spec.kl_estimator)
                    token_loss = token_loss + spec.kl_coef * kl
                if spec.entropy_coef:
                    token_loss = token_loss - spec.entropy_coef * entropy
                mask = batch.response_mask
                # FSDP averages gradients over ranks, hence the world_size factor.
                loss = masked_sum(token_loss, mask) / normaliser * self.world_size
                loss.backward()
                with torch.no_grad():
                    has_engine = batch.engine_mask
                    sums += torch.tensor([
                        masked_sum(token_loss, mask).item(),
                        masked_sum(kl, mask).item(),
                        masked_sum(terms.clipped, mask).item(),
                        masked_sum(entropy, mask).item(),
                        masked_sum((old_logprobs - batch.engine_logprobs).abs(), has_engine).item(),
                        mask.sum().item(),
                        has_engine.sum().item(),
                    ], dtype=torch.float64)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(float(grad_norm))
            if not math.isfinite(grad_norms[-1]):
                # Skip the update rather than poison the weights; the coordinator reports it.
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()

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
        }

    # ---- weights ------------------------------------------------------------------------
    def sync_weights(
        self, engine_url: str | None, engine_tp_size: int, bucket_bytes: int, weight_version: int
    ) -> dict:
        """Push the weights to this rank's colocated engine (or just join the gathers)."""
        client = EngineWeightClient(engine_url, engine_tp_size) if engine_url else None
        stats = sync_weights_colocated(
            self.model.named_parameters(), bucket_bytes, client, str(weight_version), self.backend
        )
        return stats.as_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of every parameter (collective; for tests and export)."""
        from weight_sync.buckets import gather_full_tensor

        return {name: gather_full_tensor(p).cpu().clone() for name, p in self.model.named_parameters()}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

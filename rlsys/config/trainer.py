"""trainer: the FSDP2 trainer ranks, their optimizer and how they batch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlsys.section import Section


class TrainerConfig(Section):
    num_ranks: int = Field(2, ge=1, description="Trainer ranks (processes; one GPU each on GPU) sharing the model "
                           "with FSDP2.")
    total_steps: int = Field(100, ge=1, description="Training steps (rollout batches) of the run.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate (the peak, with a schedule).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient norm clipped to this before each optimizer step.")
    call_timeout_s: float | None = Field(
        3600.0, gt=0, description="Seconds the driver waits for the trainer ranks to finish one call (a train step, "
        "the log-probs, a weight sync, a sleep or wake-up, a checkpoint save or load); past it the Python stacks of "
        "every process land in RUN_DIR/hangs/ and the run stops, naming the ranks inside a collective and those "
        "not, or restarts the trainers from a checkpoint (checkpoint.max_auto_resumes). null: no limit.")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="Steps in a row whose loss or gradient norm is not finite (their updates skipped) "
        "after which the run stops with an error.")
    packing: bool = Field(True, description="Pack sequences back to back (no padding) in micro-batches.")
    max_tokens_per_microbatch: int = Field(4096, ge=16, description="Token budget of a packed micro-batch.")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per padded micro-batch (packing off).")
    mini_batches_per_step: int = Field(1, ge=1, description="Optimizer steps per rollout batch.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After the warmup: lr throughout, or cosine decay to min_lr_ratio * lr.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward instead of keeping them (less memory, more compute).",
    )
    offload_between_steps: bool | None = Field(
        None, description="Colocated: sleep (offload params, grads, optimizer) outside the train phase, so the "
        "engines get the device. Default: on when the run uses GPUs; off on CPU, where the trainer and the engines "
        "share host memory either way and the hand-off only costs time (set true to exercise it there).",
    )
    reference_placement: Literal["auto", "device", "host"] = Field(
        "auto", description="Where the frozen reference model of a KL term (algorithm.use_kl_loss, kl_in_reward) "
        "keeps its fp32 shards: on each rank's device (its forward streams nothing from the host: faster, at 4 bytes "
        "a parameter over num_ranks of device memory), on the host (FSDP streams it to the device layer by layer "
        "each forward), or auto: on the device when the memory plan fits with it there, else on the host (`rlsys "
        "plan` shows the choice). On CPUs both are host memory; auto keeps the host path there.",
    )
    threads_per_rank: int | None = Field(
        None, ge=1, description="CPU threads of each rank's math. Default: its node's cores divided among the run's "
        "processes that compute at the same time on that node (colocated: the trainer ranks while they train; "
        "disaggregated: trainer ranks and engines).",
    )
    logprob_chunk_tokens: int = Field(
        512, ge=0, description="Token log-probs (and entropy) are computed from the last hidden states this many "
        "tokens at a time, never keeping full-vocabulary logits for backward (0: one unchunked pass that keeps "
        "them, as plain autograd does; only for comparison).",
    )

    context_parallel_size: int = Field(
        1, ge=1, description="Ranks that share each sequence (context parallelism, CP): every sequence's tokens "
        "are split over a group of this many ranks, so one sequence's activations need not fit one rank. Ranks form "
        "num_ranks / CP data-parallel groups; the parameters stay sharded over all ranks. Must divide num_ranks.",
    )
    context_parallel_style: Literal["ring", "ulysses"] = Field(
        "ring", description="How attention crosses a CP group: ring (each rank keeps its queries and key/value "
        "chunks pass around the ring; sequences split zigzag so causal work is balanced) or ulysses (all-to-all "
        "from a sequence split to a head split around attention; heads and KV heads must divide by CP).",
    )

    @property
    def data_parallel_size(self) -> int:
        """Groups of ranks that take different sequences: num_ranks / context_parallel_size."""
        return self.num_ranks // self.context_parallel_size

    def sleeps_between_steps(self, colocated: bool, has_gpu: bool) -> bool:
        """Whether trainer ranks offload between train phases (only colocated ones can)."""
        return colocated and (self.offload_between_steps if self.offload_between_steps is not None else has_gpu)

    @model_validator(mode="after")
    def _betas(self):
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"betas must each be in [0, 1) (AdamW's moment decay rates), got {list(self.betas)}")
        return self

    @model_validator(mode="after")
    def _context_parallel_divides_ranks(self):
        if self.num_ranks % self.context_parallel_size:
            raise ValueError(f"context_parallel_size ({self.context_parallel_size}) must divide num_ranks "
                             f"({self.num_ranks}): each CP group is that many ranks")
        return self

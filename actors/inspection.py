"""A trainer rank that also answers what tests, benches and the GPU proof kit ask and a run never
does: the full weights, the gradients of one loss without an update, the host memory of the load,
and a rebuild for another spec in the process group it has joined (a rank's start is ~10 CPU-seconds
of imports, which tests that need many short-lived groups spend once: tests/trainer_pool.py).
Kept out of `TrainerWorker`, so the production class holds what a run calls; no Ray here (the GPU
kit builds one in its own process). Its Ray group: inspectable_group.py."""

from __future__ import annotations

import torch

from rlsys.actors.trainer import TrainerSpec, TrainerWorker
from rlsys.records import TrainSequence
from rlsys.weight_sync.buckets import gather_full_tensor


class InspectableTrainerWorker(TrainerWorker):
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of every parameter. Collective."""
        return {name: gather_full_tensor(p).cpu().clone() for name, p in self.model.named_parameters()}

    def loss_gradients(self, sequences: list[TrainSequence]) -> dict[str, torch.Tensor]:
        """Full gradients of the step's loss on `sequences` as one mini-batch, no update. Collective."""
        plan = self._plan([sequences])
        self._attach_old_and_ref_logprobs(plan)
        self._backward_mini_batch(plan[0])
        grads = {name: gather_full_tensor(p.grad).cpu().clone() for name, p in self.model.named_parameters()
                 if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    def load_memory_report(self) -> dict:
        """Host memory around the policy's load: resident before, this process's peak after, and
        the full model's fp32 bytes."""
        return dict(self.load_memory)

    def built(self) -> bool:
        """Whether this rank holds a model (built, and not released since)."""
        return self.model is not None

    def rebuild(self, spec: TrainerSpec) -> None:
        """This rank anew for `spec`, as a new rank of the same group would start (`respec`, then
        `build`). Collective (every rank of the group rebuilds with the same spec). A process's peak
        resident memory is not reset: a test that measures a load's peak needs a new group."""
        self.respec(spec)
        self.build()


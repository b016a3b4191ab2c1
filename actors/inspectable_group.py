"""A TrainerGroup of `InspectableTrainerWorker` (inspection.py) with their fan-outs: what tests and
benches ask of a group of ranks and a run never does.

    group = InspectableTrainerGroup(spec, num_ranks=2)
    group.train_step(batch); group.full_state_dict()
"""

from __future__ import annotations

from dataclasses import replace

from rlsys.actors.group import TrainerGroup, weighed
from rlsys.actors.inspection import InspectableTrainerWorker
from rlsys.actors.trainer import TrainerSpec
from rlsys.records import TrainSequence


class InspectableTrainerGroup(TrainerGroup):
    def __init__(self, spec: TrainerSpec, num_ranks: int, actor_options: list[dict] | None = None,
                 env_vars: dict[str, str] | None = None, worker_cls: type = InspectableTrainerWorker):
        super().__init__(spec, num_ranks, actor_options, env_vars, worker_cls)

    def full_state_dict(self) -> dict:
        return self._on_every_rank("full_state_dict", bounded=False)[0]

    def loss_gradients(self, sequences: list[TrainSequence]) -> dict:
        """Gradients of the loss of `sequences` as one global mini-batch (rank 0's full copy)."""
        sequences = weighed(sequences, self.spec)
        shares = self._shares(sequences)
        return self._wait([w.loss_gradients.remote([sequences[i] for i in share])
                           for w, share in zip(self.workers, shares, strict=True)], "loss_gradients")[0]

    def load_memory_reports(self) -> list[dict]:
        return self._on_every_rank("load_memory_report", bounded=False)

    def rebuild(self, spec: TrainerSpec) -> None:
        """The group anew for `spec` on its running ranks (`InspectableTrainerWorker.rebuild`): as a
        group started with it, without a rank's ~10 CPU-seconds of start-up."""
        self._wait([w.rebuild.remote(replace(spec)) for w in self.workers], "rebuild")
        self.spec, self.asleep, self.hung = spec, False, False

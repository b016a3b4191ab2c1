"""What the components report while a run runs, and who answers it.

A `RunEvents` is made before the components and handed to each at construction (the trainer group
as its `TrainerEvents`, the rollout manager as its `EngineEvents`), so no component is patched
afterwards. What answers an event is the run's and exists only once the run does: `follow` sets it
(the hang reporter, which reads every process's stacks, and the step that brings a restarted engine
to the trainer's weights). Until then an event is answered by nothing: a hang while the ranks build
their models is raised without stacks, as before any run existed.
"""

from __future__ import annotations

from collections.abc import Callable

from rlsys.run.hangs import HangReporter


class RunEvents:
    def __init__(self):
        self._hangs: HangReporter | None = None
        self._bring_up_to_date: Callable[[int], None] | None = None

    def follow(self, hangs: HangReporter, bring_up_to_date: Callable[[int], None]) -> None:
        """From now on: stacks through `hangs`, a restarted engine `bring_up_to_date(index)`."""
        self._hangs, self._bring_up_to_date = hangs, bring_up_to_date

    def stop_following(self) -> None:
        """The run's processes are stopping: events are answered by nothing again."""
        self._hangs, self._bring_up_to_date = None, None

    def stacks_on_request(self) -> dict | None:
        """Every process's stacks, asked for through the status API (RunStatus.stacks_provider); None
        while no run follows (before its processes are up, or once they stop)."""
        hangs = self._hangs
        return hangs.on_request() if hangs is not None else None

    def collect_stacks(self, what: str) -> None:
        """Every process's stacks, saved under RUN_DIR/hangs/ and named for `what` (a failure that may
        be a hang somewhere else); never raises."""
        if self._hangs is not None:
            self._hangs.collect_safely(what)

    # TrainerEvents (actors/group.py)
    def trainer_hung(self, what: str, ranks: list[int]) -> str:
        """Stacks of every process when trainer ranks pass trainer.call_timeout_s; where each rank was."""
        return self._hangs.on_trainer_hang(what, ranks) if self._hangs is not None else ""

    # EngineEvents (rollout/manager.py)
    def engine_silent(self, index: int, why: str) -> None:
        self.collect_stacks(f"engine-{index} stopped after {why}")

    def engine_restarted(self, index: int) -> None:
        if self._bring_up_to_date is not None:
            self._bring_up_to_date(index)

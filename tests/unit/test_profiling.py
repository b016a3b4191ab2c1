"""profile.steps: the ranks' torch.profiler traces and the driver's phase timeline, written for the
chosen steps only; bad step ranges are refused before anything starts."""

import contextlib
import json
import logging

import pytest
import torch

from rlsys.actors.profiling import RankProfiler
from rlsys.config import ConfigError, load_config
from rlsys.run.profiling import TIMELINE_FILE, StepProfiler
from rlsys.system.backend import make_backend
from tests.helpers import write_config


@pytest.mark.parametrize("steps, message", [
    ("[3, 1]", "0 <= first <= last"),
    ("[-1, 2]", "0 <= first <= last"),
    ("[5, 9]", "starts at step 5, but the run's steps are 0..4"),
])
def test_a_step_range_that_cannot_be_profiled_is_refused(tmp_path, tiny_model_dir, steps, message):
    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(path, [f"profile.steps={steps}", "trainer.total_steps=5"])
    assert load_config(path, ["profile.steps=[4, 9]", "trainer.total_steps=5"]).profile.steps == (4, 9)
    assert load_config(path, []).profile.steps is None


def test_a_rank_profile_holds_the_ops_it_ran_and_a_table_of_them(tmp_path):
    profiler = RankProfiler(make_backend(False), rank=1)
    assert profiler.stop(str(tmp_path)) == []  # nothing recording: nothing written
    assert isinstance(profiler.phase("train_step"), contextlib.nullcontext)  # off: not even a record_function
    profiler.start()
    with profiler.phase("train_step"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    trace, table = profiler.stop(str(tmp_path / "profile"))
    assert trace.endswith("trainer-rank1.json") and table.endswith("trainer-rank1-ops.txt")
    events = json.loads(open(trace).read())["traceEvents"]
    names = {event.get("name") for event in events}
    assert "aten::mm" in names
    phase = next(e for e in events if e.get("name") == "rlsys.train_step")
    matmul = next(e for e in events if e.get("name") == "aten::mm")
    assert phase["ts"] <= matmul["ts"] <= matmul["ts"] + matmul["dur"] <= phase["ts"] + phase["dur"]  # holds its ops
    assert "aten::mm" in open(table).read()
    assert not profiler.recording


class _Group:
    def __init__(self, fail_stop: bool = False):
        self.calls: list[str] = []
        self.fail_stop = fail_stop

    def start_profile(self):
        self.calls.append("start")

    def stop_profile(self, directory, timeout_s=None):
        self.calls.append("stop")
        if self.fail_stop:
            raise RuntimeError("The actor died unexpectedly before finishing this task.\nmore")
        return [f"{directory}/trainer-rank0.json"]


def _run_steps(profiler: StepProfiler, steps, last):
    for step in steps:
        profiler.step_starting(step)
        for phase in ("generate", "train", "sync"):
            with profiler.span(step, phase):
                pass
        profiler.step_ended(step, last_step=step == last)


def test_only_the_chosen_steps_are_recorded_and_the_timeline_names_their_phases(tmp_path):
    group = _Group()
    profiler = StepProfiler((1, 2), tmp_path, lambda: group)
    _run_steps(profiler, range(5), last=4)
    assert group.calls == ["start", "stop"]
    events = json.loads((tmp_path / "profile" / TIMELINE_FILE).read_text())["traceEvents"]
    spans = [(e["args"]["step"], e["name"]) for e in events if e["ph"] == "X"]
    assert spans == [(s, p) for s in (1, 2) for p in ("generate", "train", "sync")]
    assert all(e["dur"] >= 0 and e["ts"] > 1e15 for e in events if e["ph"] == "X")  # wall-clock microseconds


def test_off_records_nothing_and_a_run_ending_early_or_a_dead_rank_still_leaves_the_timeline(tmp_path, caplog):
    group = _Group()
    _run_steps(StepProfiler(None, tmp_path / "off", lambda: group), range(3), last=2)
    assert group.calls == [] and not (tmp_path / "off" / "profile").exists()

    ended_early = StepProfiler((1, 8), tmp_path / "early", lambda: group)
    _run_steps(ended_early, range(3), last=2)  # the run's last step comes before the range's end
    assert group.calls == ["start", "stop"] and (tmp_path / "early" / "profile" / TIMELINE_FILE).is_file()

    dead = _Group(fail_stop=True)
    profiler = StepProfiler((0, 5), tmp_path / "dead", lambda: dead)
    _run_steps(profiler, range(2), last=99)
    with caplog.at_level(logging.WARNING, logger="rlsys.run.profiling"):
        profiler.finish()  # what the loop's `finally` does when the run fails
    assert "could not be written: The actor died unexpectedly" in caplog.text
    assert (tmp_path / "dead" / "profile" / TIMELINE_FILE).is_file()
    profiler.finish()  # once only
    assert dead.calls == ["start", "stop"]

    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "profile").write_text("a file where the directory would go")
    blocked = StepProfiler((0, 0), tmp_path / "blocked", lambda: group)
    with caplog.at_level(logging.WARNING, logger="rlsys.run.profiling"):
        _run_steps(blocked, range(1), last=0)  # does not raise: the run ends as it would have
    assert "profile timeline could not be written" in caplog.text

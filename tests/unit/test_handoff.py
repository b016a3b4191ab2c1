"""The colocated turn order on a shared GPU (rlsys/run/handoff.py), call by call.

The trainer group and the engines are recording stand-ins here: the order is DeviceHandoff's alone,
and the real trainer and engines take these turns in tests/e2e/test_quickstart.py (slow, Ray + SGLang).
"""

import json
import re
import subprocess
import sys

import pytest

from rlsys.rollout.engine import releasable_bytes
from rlsys.run.handoff import (
    ALL_REGIONS,
    WEIGHTS,
    DeviceHandoff,
    engine_gave_memory_back,
    trainer_gave_memory_back,
)
from tests.helpers import REPO

GB = 10**9


class _Calls(list):
    def report(self, call: str, **fields) -> dict:
        self.append(call)
        return {"bytes": 1, "seconds": 0.0, "held_bytes": 1, **fields}


class _Trainer:
    def __init__(self, calls: _Calls):
        self.calls = calls

    def wake_up(self) -> dict:
        return self.calls.report("trainer.wake_up")

    def release_cached_memory(self) -> dict:
        return self.calls.report("trainer.release_cached_memory")

    def sleep(self) -> dict:
        return self.calls.report("trainer.sleep")


class _Engines:
    def __init__(self, calls: _Calls):
        self.calls = calls

    def memory(self) -> list[dict]:
        return [{"device_bytes": 1, "releasable_bytes": 5}, {"device_bytes": 1, "releasable_bytes": 7}]

    def release_memory(self, regions: list[str]) -> list[dict]:
        self.calls.append(f"engines.release {sorted(regions)}")
        return [{"device_bytes": 1, "released": regions}]

    def resume_memory(self, regions: list[str]) -> list[dict]:
        self.calls.append(f"engines.resume {sorted(regions)}")
        return [{"device_bytes": 1, "released": []}]


def _step(handoff: DeviceHandoff) -> None:
    """The hand-off turns of one step, as train_loop and push_weights take them."""
    handoff.to_trainer(step=0)
    # ... train_step: the caching allocator now holds the step's activations and gradients
    handoff.weights_to_engines()
    # ... sync_weights, checkpoint
    handoff.to_engines(step=0)


def test_engines_take_their_weights_back_only_after_the_trainer_returned_its_train_peak(tmp_path):
    calls = _Calls()
    handoff = DeviceHandoff(_Trainer(calls), _Engines(calls), enabled=True, log_path=tmp_path / "handoff.jsonl")
    _step(handoff)
    assert calls == [
        f"engines.release {sorted(ALL_REGIONS)}",
        "trainer.wake_up",
        "trainer.release_cached_memory",  # before any engine memory comes back
        f"engines.resume {[WEIGHTS]}",
        "trainer.sleep",  # offloads, drops the staging buffer, empties the cache
        f"engines.resume {sorted(ALL_REGIONS)}",
    ]
    logged = [json.loads(line)["event"] for line in (tmp_path / "handoff.jsonl").read_text().splitlines()]
    assert logged == ["engines_release", "trainer_wake", "trainer_release_cache", "engines_resume_weights",
                      "trainer_sleep", "engines_resume_all"]


def test_without_sleeping_trainers_there_are_no_turns():
    calls = _Calls()
    _step(DeviceHandoff(_Trainer(calls), _Engines(calls), enabled=False))
    assert calls == []


def test_each_step_records_what_the_engines_release_must_free():
    calls = _Calls()
    metrics = DeviceHandoff(_Trainer(calls), _Engines(calls), enabled=True).to_trainer(step=0)
    assert metrics["memory_engine_releasable_bytes"] == 5  # the least of the engines' weights + KV cache


# The smoke model on one GPU (issue 47): ~2 GB of CUDA contexts and workspaces stay in the device-wide
# figure; the engine's weights + KV cache are 0.8 GB; the trainer's own reservations, awake and asleep.
SMOKE_ROW = {"memory_engine_serving_bytes": int(2.9 * GB), "memory_engine_releasable_bytes": int(0.8 * GB),
             "memory_trainer_awake_bytes": int(1.6 * GB), "memory_trainer_asleep_bytes": int(0.05 * GB)}


@pytest.mark.parametrize(("released", "passes"), [
    (int(2.1 * GB), True),  # freed its 0.8 GB: the contexts stay, far above half of the total
    (int(2.15 * GB), True),  # 0.75 GB of 0.8 (allocator granularity, GiB rounding)
    (int(2.5 * GB), False),  # freed only half of it (e.g. the KV cache stayed)
    (int(2.9 * GB), False),  # freed nothing
])
def test_an_engine_release_is_judged_by_its_weights_and_kv_cache_not_by_the_gpu_total(released, passes):
    row = {**SMOKE_ROW, "memory_engine_released_bytes": released}
    assert engine_gave_memory_back(row) is passes


def test_an_engine_that_reports_no_weights_or_kv_cache_fails_the_check():
    row = {**SMOKE_ROW, "memory_engine_released_bytes": 0, "memory_engine_releasable_bytes": None}
    assert not engine_gave_memory_back(row)


def test_a_sleeping_trainer_holds_less_than_half_its_awake_reservation():
    assert trainer_gave_memory_back(SMOKE_ROW)
    assert not trainer_gave_memory_back({**SMOKE_ROW, "memory_trainer_asleep_bytes": int(1.5 * GB)})
    assert not trainer_gave_memory_back({**SMOKE_ROW, "memory_trainer_asleep_bytes": None})


def test_releasable_bytes_are_the_weights_and_kv_cache_sglang_reports():
    """The shape of SGLang 0.5.23's /server_info (internal_state.py: _add_memory_usage, GiB)."""
    info = {"internal_states": [{"memory_usage": {"weight": 0.186, "kvcache": 0.75, "graph": {"decode": 0.05},
                                                  "token_capacity": 16384}}]}
    assert releasable_bytes(info) == int((0.186 + 0.75) * 2**30)
    assert releasable_bytes({"internal_states": [{}]}) is None
    assert releasable_bytes({}) is None


def _smoke_summary(tmp_path, rows) -> subprocess.CompletedProcess:
    """deploy/gpu_smoke.sh's closing Python (its heredoc) on a finished run's metrics."""
    script = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", (REPO / "deploy/gpu_smoke.sh").read_text(), re.S).group(1)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return subprocess.run([sys.executable, "-", str(tmp_path)], input=script, capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def _smoke_rows(released: int) -> list[dict]:
    return [{**SMOKE_ROW, "memory_engine_released_bytes": released, "weight_version": step, "logprob_mismatch": 0.01}
            for step in range(3)]


def test_the_gpu_smoke_summary_passes_a_working_hand_off_and_fails_one_that_frees_nothing(tmp_path):
    working = _smoke_summary(tmp_path, _smoke_rows(int(2.1 * GB)))
    assert working.returncode == 0, working.stdout + working.stderr
    assert "FAIL" not in working.stdout
    stuck = _smoke_summary(tmp_path, _smoke_rows(int(2.9 * GB)))
    assert stuck.returncode == 1
    assert "FAIL engine gives its weights and KV cache back" in stuck.stdout

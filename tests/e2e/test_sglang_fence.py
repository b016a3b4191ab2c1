"""SGLang servers launched with the CPU layer (rollout/sglang/cpu_compat): one the layer refuses
stops at start-up and the launcher says why, in one message; a real engine without the layer's
speed-ups generates the greedy tokens one with them does. (The layer's checks and what it installs,
without a server: tests/unit/test_sglang_fence.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsys.config import EngineConfig, ModelConfig
from rlsys.rollout.sglang.server import ServerSpec, SGLangServer, build_env
from rlsys.system.backend import make_backend
from tests.unit.test_sglang_fence import rlsys_fence  # the layer's module, put on the path there


def _fake_sglang_dist(root: Path, version: str) -> None:
    """An installed-distribution record for sglang `version` (what importlib.metadata reads)."""
    dist = root / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")


# --- at a server's start-up ----------------------------------------------------------------------

def _start_refused(tmp_path) -> str:
    server = SGLangServer(ServerSpec(ModelConfig(path="unused")), make_backend(False), "e0", tmp_path / "engine.log")
    try:
        with pytest.raises(RuntimeError, match="during start-up") as failed:
            server.start(timeout_s=300)
    finally:
        server.stop()
    return str(failed.value)


@pytest.mark.own_engines
def test_a_server_with_another_sglang_release_stops_at_start_up_and_says_why(tmp_path, monkeypatch):
    _fake_sglang_dist(tmp_path / "site", "0.5.24")  # found before the installed 0.5.23
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    message = _start_refused(tmp_path)
    assert ("during start-up: rlsys's CPU layer for SGLang is written for sglang==0.5.23, but sglang 0.5.24 is "
            "installed") in message


# An SGLang whose scheduler's maybe_sleep_on_idle takes a parameter more; its launcher imports the
# scheduler module in a child process, then (as SGLang does when its scheduler dies) prints a
# traceback longer than the log tail the launcher shows.
FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/scheduler.py": "class Scheduler:\n    def maybe_sleep_on_idle(self, now):\n        pass\n",
    "sglang/launch_server.py": (
        "import multiprocessing, sys\n"
        "child = multiprocessing.Process(target=__import__, args=('sglang.srt.managers.scheduler',))\n"
        "child.start()\n"
        "child.join()\n"
        "print('\\n'.join(f'  traceback line {i}' for i in range(60)))\n"
        "sys.exit(1)\n"
    ),
}


@pytest.mark.own_engines
def test_a_changed_sglang_method_stops_the_server_at_start_up_and_the_launcher_says_which(tmp_path, monkeypatch):
    for name, text in FAKE_SGLANG.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    _fake_sglang_dist(tmp_path / "site", "0.5.23")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    message = _start_refused(tmp_path)
    assert ("during start-up: rlsys's CPU layer replaces SGLang's Scheduler.maybe_sleep_on_idle, written for "
            "sglang==0.5.23 where it is (self); the installed sglang 0.5.23 has (self, now).") in message
    log = (tmp_path / "engine.log").read_text()
    assert log.count(rlsys_fence.REFUSAL_MARK) == 1  # one message, no traceback of the layer's own


# --- a real engine -------------------------------------------------------------------------------

def _greedy(server: SGLangServer) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their log-probs for ragged prompts from a started CPU engine."""
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    answers = server.client.generate({
        "input_ids": prompts,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
        "return_logprob": True,
    })
    pairs = [answer["meta_info"]["output_token_logprobs"] for answer in answers]
    return [[token for _, token, *_ in p] for p in pairs], [[lp for lp, *_ in p] for p in pairs]


@pytest.mark.own_engines
def test_an_engine_without_the_speedups_generates_the_same_greedy_tokens(tiny_model_dir, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from rlsys.rollout.sglang import server as server_module

    # Both engines start at once (each start-up is mostly one single-threaded process importing
    # SGLang), each with its own RLSYS_SGLANG_CPU_SPEEDUPS in its environment.
    specs = {speedups: ServerSpec(ModelConfig(path=str(tiny_model_dir)),
                                  EngineConfig(context_length=128, max_total_tokens=4096)) for speedups in "10"}
    speedups_of = {id(spec): speedups for speedups, spec in specs.items()}
    monkeypatch.setattr(server_module, "build_env", lambda spec, backend, host="127.0.0.1": {
        **build_env(spec, backend, host), rlsys_fence.SPEEDUPS_ENV: speedups_of[id(spec)]})
    fast, plain = (SGLangServer(specs[speedups], make_backend(False), "e0", tmp_path / f"{name}.log")
                   for speedups, name in (("1", "fast"), ("0", "plain")))
    # The pool's threads outlive the servers: a server is launched with PR_SET_PDEATHSIG, which
    # fires when the *thread* that started it exits (prctl(2)), not only its process.
    with ThreadPoolExecutor(2) as pool:
        try:
            for started in [pool.submit(server.start, 600) for server in (fast, plain)]:
                started.result()
            (fast_tokens, fast_logprobs), (plain_tokens, plain_logprobs) = _greedy(fast), _greedy(plain)
        finally:
            fast.stop()
            plain.stop()
    # (Which start method the children got is not read from their command lines: SGLang renames
    # its processes ("sglang::scheduler") as they start, so that would race. That speed-ups off
    # leaves SGLang's spawn in place is test_the_speedups_can_be_switched_off_and_the_required_patches_stay.)
    # The one numerical change is the batched attention: each request's own softmax, summed in
    # another order (fp32 rounding, ~1e-7 relative per attention output; the per-call difference
    # is bounded by 1e-6 in tests/unit/test_cpu_decode.py). Through the tiny model's layers that
    # moves a log-prob by far less than 1e-4. A random model's distributions are nearly flat, so
    # two tokens can tie closer than that and greedy decoding may then take either: compare each
    # answer up to and including its first differing token (the contexts are equal until there).
    # Where the tokens differ, each engine's choice is its own maximum, so the two chosen
    # log-probs must still agree within the bound (a near tie, not a different distribution).
    worst, compared = 0.0, 0
    for fast_answer, fast_lps, plain_answer, plain_lps in zip(fast_tokens, fast_logprobs, plain_tokens,
                                                              plain_logprobs, strict=True):
        assert len(plain_answer) == len(fast_answer) == 24
        for fast_token, fast_lp, plain_token, plain_lp in zip(fast_answer, fast_lps, plain_answer, plain_lps,
                                                              strict=True):
            worst, compared = max(worst, abs(fast_lp - plain_lp)), compared + 1
            if fast_token != plain_token:
                break
    assert compared >= len(fast_tokens) and worst < 1e-4, (worst, fast_tokens, plain_tokens)

"""Start-up of the quickstart: from the command to its first step, with engines of its own and
attached to standing engines (`rlsys engines up`, rollout.attach), on this machine. Prints one JSON
object.

    .venv/bin/python bench/startup.py [--rounds 3] [--out bench/results/startup-DATE.json]

Each round runs both, in alternating order (own then attached, then attached then own: these
machines drift in speed within an hour), as `rlsys train configs/quickstart.yaml` with one step.
Both join one Ray cluster that this script starts first (`ray start --head`, as `rlsys engines up`
on a machine with none does), so a run's own Ray start is not what is compared; `own_ray_cluster`
adds one run that starts its own local cluster, as a plain `rlsys train` does. The standing set is
started once, before the rounds (`engines_up_s`), and one run attaches to it before the rounds
(`attached_first_run`): it starts the trainer ranks the set then keeps (actors/warm_ranks.py), so
the rounds' attached runs build their model in warm ranks.

Per run: `to_training_s`, the seconds from the command to its "training (started in ...)" line
(the first step begins right after); and the time of each start-up line (driver ready, Ray, trainer
ranks, engines, first weights), read as the lines arrive, so the note can say where the seconds go.
`cpu_s`: the CPU-seconds each kind of process spent from the command to that line (the driver, its
trainer ranks, the engines' processes, Ray's), from psutil: what a machine's cores must do before
the first step however well it overlaps, so `cpu_floor_s` = their sum / the machine's cores is the
shortest start this process layout can have here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RLSYS = REPO / ".venv" / "bin" / "rlsys"
MARKS = {  # start-up line -> its name in the timeline
    "run directory": "driver_ready", "Ray cluster up": "ray", "attached to standing engines": "attached",
    "memory plan": "memory_plan", "warm rank(s)": "warm_ranks_taken", " ranks on ": "trainer_ranks_ready",
    "SGLang engine(s) ready": "engines_ready",
    "engines hold the trainer's weights": "weights_pushed", "training (started": "training",
}


def _kind(command: str) -> str | None:
    if "TrainerWorker" in command:
        return "trainer_ranks"
    if "sglang" in command or "RolloutEngine" in command or "EngineService" in command:
        return "engines"
    if "ray" in command or "raylet" in command or "gcs_server" in command:
        return "ray"
    if "multiprocessing" in command or "rlsys.system.reaper" in command:
        return "driver_helpers"  # the reward workers, the resource tracker, the reaper
    return None


def _cpu_seconds() -> dict[int, tuple[str | None, float]]:
    """Per process of this machine: its kind (`_kind`) and the CPU-seconds it has used."""
    seen = {}
    for process in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is not None:
            seen[process.info["pid"]] = (_kind(" ".join(process.info["cmdline"] or [])), times.user + times.system)
    return seen


def timed_run(model: Path, run_dir: Path, *overrides: str) -> dict:
    """One quickstart step; the seconds from the command to each start-up line, and the CPU-seconds
    spent until the first step by kind of process."""
    command = [str(RLSYS), "train", str(REPO / "configs" / "quickstart.yaml"), f"model.path={model}",
               f"run_dir={run_dir}", "logging.progress_bar=false", "status.port=0", "trainer.total_steps=1",
               "eval.interval=1000", *overrides]
    before = _cpu_seconds()
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver = psutil.Process(process.pid)
    timeline, lines, cpu_s = {}, [], {}
    for line in process.stdout:
        lines.append(line)
        for mark, name in MARKS.items():
            if mark in line and name not in timeline:
                timeline[name] = round(time.monotonic() - start, 2)
        if "training (started" in line and not cpu_s:
            times = driver.cpu_times()
            cpu_s["driver"] = times.user + times.system
            for pid, (kind, used) in _cpu_seconds().items():
                if kind is not None and pid != process.pid:
                    cpu_s[kind] = cpu_s.get(kind, 0.0) + used - before.get(pid, (kind, 0.0))[1]
            cpu_s = {kind: round(value, 2) for kind, value in cpu_s.items()}
    if process.wait() != 0:
        raise RuntimeError(f"rlsys train failed ({process.returncode}):\n{''.join(lines)[-3000:]}")
    return {"to_training_s": timeline.get("training"), "exit_s": round(time.monotonic() - start, 2),
            "timeline": timeline, "cpu_s": cpu_s,
            "cpu_floor_s": round(sum(cpu_s.values()) / (os.cpu_count() or 1), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    os.environ.update(env)
    with tempfile.TemporaryDirectory(prefix="rlsys-startup-") as scratch:
        scratch = Path(scratch)
        model = scratch / "model"
        subprocess.run([str(RLSYS), "-q", "make-tiny-model", str(model)], check=True)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus=64",
                        "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True)
        try:
            address = "placement.ray_address=auto"
            began = time.monotonic()
            subprocess.run([str(RLSYS), "-q", "engines", "up", str(REPO / "configs" / "quickstart.yaml"),
                            f"model.path={model}", "--name", "bench", "--log-dir", str(scratch / "engines")],
                           check=True)
            engines_up_s = round(time.monotonic() - began, 2)
            attached_first = timed_run(model, scratch / "attached-first", address, "rollout.attach=bench")
            own, attached = [], []
            for round_ in range(args.rounds):
                order = ("own", "attached") if round_ % 2 == 0 else ("attached", "own")
                for kind in order:
                    run_dir = scratch / f"{kind}-{round_}"
                    if kind == "own":
                        own.append(timed_run(model, run_dir, address))
                    else:
                        attached.append(timed_run(model, run_dir, address, "rollout.attach=bench"))
            own_cluster = timed_run(model, scratch / "own-cluster")
            subprocess.run([str(RLSYS), "-q", "engines", "down", "--name", "bench"], check=True)
        finally:
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop"], capture_output=True)

    def median(runs: list[dict]) -> float:
        values = sorted(run["to_training_s"] for run in runs)
        return values[len(values) // 2]

    result = {
        "bench": "startup", "date": str(date.today()), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "rounds": args.rounds, "engines_up_s": engines_up_s,
        "own_engines_to_training_s_median": median(own), "attached_to_training_s_median": median(attached),
        "attached_over_own": round(median(attached) / median(own), 3),
        "attached_first_run_to_training_s": attached_first["to_training_s"],
        "own_engines": own, "attached": attached, "attached_first_run": attached_first,
        "own_ray_cluster_and_engines": own_cluster,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

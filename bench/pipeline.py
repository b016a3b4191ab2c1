"""One-step-off-policy pipeline: the disaggregated quickstart with rollout.mode sync and async (max_staleness 1),
one after the other on this machine. Prints one JSON object.

    .venv/bin/python bench/pipeline.py [--steps 120] [--rounds 2] [--out bench/results/pipeline-DATE.json]

The trainer (one rank) and the engine (one) sit on their own cores (placement.mode
disaggregated, trainer.num_ranks=1, rollout.num_engines=1), so with staleness 1 the engine
generates step t+1's samples while the trainer trains on step t's. Steps per second are
measured over every step after `--warmup` (eval steps included: both runs evaluate alike);
`staleness1_over_staleness0` is their ratio (`..._without_eval`: the same with the eval phases'
seconds taken out). `staleness1_final_eval` is the last greedy eval of
the staleness-1 run, which must still learn the task (the lowest over the rounds).
`--rounds` (default 2) pairs run in ABBA order (0 then 1, then 1 then 0): these machines drift in
speed by up to 30% within an hour, which a single pair measures as much as the pipeline. Steps
per second are pooled over the rounds; `staleness1_over_staleness0_per_round` gives each pair's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RLSYS = REPO / ".venv" / "bin" / "rlsys"


def run(staleness: int, steps: int, model: Path, run_dir: Path) -> list[dict]:
    command = [str(RLSYS), "train", str(REPO / "configs" / "quickstart_disaggregated.yaml"),
               f"model.path={model}", f"run_dir={run_dir}", "logging.progress_bar=false", "status.port=0",
               "trainer.num_ranks=1", "rollout.num_engines=1", f"trainer.total_steps={steps}",
               f"rollout.mode={{type: async, max_staleness: {staleness}}}" if staleness else "rollout.mode=sync",
               "weight_sync.verify=false"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"rlsys train failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(runs: list[list[dict]], warmup: int) -> dict:
    """Pooled over `runs` (one per round): every step after each run's first `warmup`."""
    measured = [r for rows in runs for r in rows[warmup:]]
    seconds = sum(r["time_step_s"] for r in measured)
    final_evals = [evals[-1] for evals in ([r["eval_reward_mean"] for r in rows if "eval_reward_mean" in r]
                                           for rows in runs) if evals]

    def mean(key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in measured) / len(measured), 4)

    train_seconds = seconds - sum(r.get("time_eval_s", 0.0) for r in measured)
    return {"steps_per_s": round(len(measured) / seconds, 3), "step_s": round(seconds / len(measured), 4),
            "steps_per_s_without_eval": round(len(measured) / train_seconds, 3),
            "reward_s": mean("reward_s"),
            "generate_wait_s": mean("time_generate_s"), "train_s": mean("time_train_s"), "sync_s": mean("time_sync_s"),
            "overlapped_generate_s": mean("prefetch_s"), "staleness_mean": mean("staleness_mean"),
            "final_eval": min(final_evals) if final_evals else None, "final_eval_per_round": final_evals,
            "first_eval_at_least_0.9": [next((r["step"] for r in rows if r.get("eval_reward_mean", 0) >= 0.9), None)
                                        for rows in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="staleness 0/1 pairs, in ABBA order")
    parser.add_argument("--model", default=str(REPO / ".cache" / "tiny-model"))
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        subprocess.run([str(RLSYS), "make-tiny-model", str(model)], check=True)
    rows: dict[int, list[list[dict]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="rlsys-pipeline-") as root:
        for index in range(args.rounds):
            for staleness in ((0, 1) if index % 2 == 0 else (1, 0)):
                rows[staleness].append(run(staleness, args.steps, model, Path(root) / f"staleness{staleness}-{index}"))
    runs = {staleness: summarize(rows[staleness], args.warmup) for staleness in (0, 1)}
    per_round = [round(summarize([one], args.warmup)["steps_per_s"] / summarize([zero], args.warmup)["steps_per_s"], 3)
                 for zero, one in zip(rows[0], rows[1], strict=True)]
    result = {
        "machine": {"cpus": os.cpu_count()},
        "config": "configs/quickstart_disaggregated.yaml, 1 trainer rank, 1 engine, weight_sync.verify=false",
        "steps": args.steps, "warmup_steps": args.warmup, "rounds": args.rounds,
        "staleness1_over_staleness0": round(runs[1]["steps_per_s"] / runs[0]["steps_per_s"], 3),
        "staleness1_over_staleness0_per_round": per_round,
        # the same without the eval phases (greedy eval every 10 steps, never overlapped)
        "staleness1_over_staleness0_without_eval": round(
            runs[1]["steps_per_s_without_eval"] / runs[0]["steps_per_s_without_eval"], 3),
        "staleness1_final_eval": runs[1]["final_eval"],
        "staleness0": runs[0], "staleness1": runs[1],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

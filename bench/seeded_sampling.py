"""Do two runs with one seed and a different number of engines sample the same tokens? Each sample
draws from its own seed (rollout/seeds.py), so they should, except where a different batch
composition changes a logit in its last bits and the seeded draw then picks the other of two
near-tied tokens (after which the runs train on different samples and part). Prints one JSON object.

    .venv/bin/python bench/seeded_sampling.py [--steps 5] [--out bench/results/seeded_sampling-DATE.json]

Runs `configs/quickstart_disaggregated.yaml` (2 trainer ranks) with 1 and with 2 engines, 8 tokens
a response, every step's samples saved (logging.save_rollouts), and compares them step by step:
samples whose response ids differ, tokens that differ, and the first step where any does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlsys.observability.rollouts import read_rollouts  # noqa: E402


def _run(run_dir: Path, engines: int, steps: int) -> list[list[dict]]:
    command = [sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs/quickstart_disaggregated.yaml"),
               f"run_dir={run_dir}", f"rollout.num_engines={engines}", f"trainer.total_steps={steps}",
               "rollout.max_new_tokens=8", "rollout.engine.context_length=64", "eval.interval=1000",
               "logging.save_rollouts=true", "logging.progress_bar=false", "status.port=0",
               f"model.path={REPO / '.cache/tiny-model'}"]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if finished.returncode != 0:
        raise SystemExit(f"the run with {engines} engine(s) failed:\n{finished.stderr[-3000:]}")
    return read_rollouts(run_dir / "rollouts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        one, two = (_run(Path(scratch) / f"engines_{n}", n, args.steps) for n in (1, 2))
    per_step = []
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        samples = sum(x["response_ids"] != y["response_ids"] for x, y in zip(a, b, strict=True))
        tokens = sum(len(x["response_ids"]) for x in a)
        differing = sum(p != q for x, y in zip(a, b, strict=True)
                        for p, q in zip(x["response_ids"], y["response_ids"], strict=False))
        per_step.append({"step": step, "samples": len(a), "samples_differing": samples, "tokens": tokens,
                         "tokens_differing": differing})
    first = next((s["step"] for s in per_step if s["samples_differing"]), None)
    result = {"bench": "seeded_sampling", "date": date.today().isoformat(), "steps": args.steps,
              "config": "configs/quickstart_disaggregated.yaml, 8 tokens a response, 1 vs 2 engines",
              "first_step_differing": first,
              "share_of_samples_differing_before_the_runs_part": (
                  sum(s["samples_differing"] for s in per_step[:first + 1]) / sum(s["samples"] for s in per_step[:first + 1])
                  if first is not None else 0.0),
              "per_step": per_step}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

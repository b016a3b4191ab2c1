"""Long-tailed response lengths: plain GRPO steps, partial rollouts and staleness 2, side by side.
Prints one JSON object.

    .venv/bin/python bench/long_tail.py [--steps 40] [--rounds 2] [--out bench/results/long_tail-DATE.json]

The task (built here, with its reward and its model): copy a string of digits, "80417>" -> "80417".
Nine prompts in ten are 1-3 digits long, one in ten 24-40, so most answers take a few tokens
and a few run to the token limit (rollout.max_new_tokens 256: the long copies the model has not
learnt to end). The tiny model is first taught the task's form by a short supervised fine-tune
(it copies most short strings, stops after a copy, and gets long ones wrong), so the lengths of
its answers follow the prompts' from the first GRPO step; GRPO then raises its exact-copy rate.
Reward: 1.0 for an exact copy, otherwise 0.9 x the share of positions right (over the longer of
answer and label).

Each round runs the same config three ways on the disaggregated layout (1 trainer rank, 1 engine):
plain (a step waits for its slowest group), `rollout.mode: partial` (a step takes the groups
finished first, aborts the rest and continues them at the next step) and `rollout.mode: async`
2. Steps per second are over every step after `--warmup`; the final eval is the last eval's mean
reward of greedy answers to 100 held-out prompts of the same length mix (the reward above). `--rounds` pairs run in
rotating order (these machines drift in speed within an hour); `partial_over_plain` pools the
rounds, `..._per_round` gives each round's, and `final_eval_spread` the range of a mode's final
eval over the rounds, the run-to-run spread its final eval is judged against.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
RLSYS = REPO / ".venv" / "bin" / "rlsys"
MAX_NEW_TOKENS = 256

REWARD = '''
def copy_reward(prompt, response, label, metadata):
    """1.0 for an exact copy; otherwise the share of positions right, over the longer string."""
    response = response.strip()
    if response == label:
        return 1.0
    right = sum(a == b for a, b in zip(response, label))
    return 0.9 * right / max(len(response), len(label), 1)
'''

MODES = {
    "plain": [],
    "partial": ["rollout.mode=partial"],
    "staleness2": ["rollout.mode={type: async, max_staleness: 2}"],
}


def copy_length(rng: random.Random) -> int:
    return rng.randint(24, 40) if rng.random() < 0.1 else rng.randint(1, 3)


def write_task(root: Path, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    paths = []
    for name, count in (("train", 2000), ("eval", 100)):
        path = root / f"{name}.jsonl"
        with path.open("w") as handle:
            for _ in range(count):
                digits = "".join(rng.choice("0123456789") for _ in range(copy_length(rng)))
                handle.write(json.dumps({"prompt": f"{digits}>", "label": digits}) + "\n")
        paths.append(path)
    (root / "reward.py").write_text(REWARD)
    return paths[0], paths[1]


def fine_tune(model_dir: Path, train: Path, steps: int, seed: int = 0) -> None:
    """Teach the tiny model the task's form: prompt -> digits -> <eos>, loss on the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["label"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((prompt + answer, [-100] * len(prompt) + answer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, 32)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir, safe_serialization=True)


def config(root: Path, model: Path, train: Path, evaluation: Path) -> Path:
    base = yaml.safe_load((REPO / "configs" / "quickstart_disaggregated.yaml").read_text())
    base["model"]["path"] = str(model)
    base["data"] = {"train_path": str(train), "eval_path": str(evaluation), "prompts_per_step": 16}
    base["reward"] = {"function": f"{root / 'reward.py'}:copy_reward"}
    base["rollout"].update(num_engines=1, max_new_tokens=MAX_NEW_TOKENS)
    base["rollout"]["engine"].update(context_length=320)
    base["trainer"].update(num_ranks=1, lr=0.0005)
    base["weight_sync"]["verify"] = False
    path = root / "long_tail.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def run(config_path: Path, mode: str, steps: int, run_dir: Path) -> list[dict]:
    command = [str(RLSYS), "train", str(config_path), f"run_dir={run_dir}", "logging.progress_bar=false",
               "status.port=0", f"trainer.total_steps={steps}", "eval.interval=10", *MODES[mode]]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"rlsys train ({mode}) failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(runs: list[list[dict]], warmup: int) -> dict:
    measured = [r for rows in runs for r in rows[warmup:]]
    seconds = sum(r["time_step_s"] for r in measured)
    final_evals = [[r["eval_reward_mean"] for r in rows if "eval_reward_mean" in r][-1] for rows in runs]

    def mean(key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in measured) / len(measured), 4)

    train_seconds = seconds - sum(r.get("time_eval_s", 0.0) for r in measured)
    return {"steps_per_s": round(len(measured) / seconds, 3), "step_s": round(seconds / len(measured), 4),
            "steps_per_s_without_eval": round(len(measured) / train_seconds, 3),
            "generate_wait_s": mean("time_generate_s"), "train_s": mean("time_train_s"), "sync_s": mean("time_sync_s"),
            "response_len_mean": mean("response_len_mean"), "first_eval": runs[0][0].get("eval_reward_mean"),
            "final_eval": round(sum(final_evals) / len(final_evals), 4), "final_eval_per_round": final_evals,
            "final_eval_spread": round(max(final_evals) - min(final_evals), 4),
            "partial_age_mean": mean("partial_age_mean"), "partial_samples_carried": mean("partial_samples_carried"),
            "staleness_mean": mean("staleness_mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="rlsys-long-tail-") as directory:
        root = Path(directory)
        train, evaluation = write_task(root)
        model = root / "model"
        subprocess.run([str(RLSYS), "make-tiny-model", str(model)], check=True, capture_output=True)
        fine_tune(model, train, args.sft_steps)
        config_path = config(root, model, train, evaluation)
        order = list(MODES)
        for index in range(args.rounds):
            for mode in order[index % len(order):] + order[:index % len(order)]:
                rows[mode].append(run(config_path, mode, args.steps, root / f"{mode}-{index}"))
    runs = {mode: summarize(rows[mode], args.warmup) for mode in MODES}

    def ratio(mode: str, key: str = "steps_per_s") -> float:
        return round(runs[mode][key] / runs["plain"][key], 3)

    result = {
        "machine": {"cpus": os.cpu_count()},
        "task": "copy 1-3 digits (9 prompts in 10) or 24-40 (1 in 10); max_new_tokens 256; 16 prompts x 8 samples",
        "config": "configs/quickstart_disaggregated.yaml on the task, 1 trainer rank, 1 engine",
        "steps": args.steps, "warmup_steps": args.warmup, "rounds": args.rounds, "sft_steps": args.sft_steps,
        "partial_over_plain": ratio("partial"), "staleness2_over_plain": ratio("staleness2"),
        # the same without the eval phases (a greedy pass over 100 prompts every 10 steps, alike in every mode)
        "partial_over_plain_without_eval": ratio("partial", "steps_per_s_without_eval"),
        "staleness2_over_plain_without_eval": ratio("staleness2", "steps_per_s_without_eval"),
        "partial_over_plain_per_round": [
            round(summarize([p], args.warmup)["steps_per_s"] / summarize([q], args.warmup)["steps_per_s"], 3)
            for p, q in zip(rows["partial"], rows["plain"], strict=True)],
        **runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""rlsys against TRL's GRPOTrainer on the same GRPO work, one after the other on this machine.
Prints one JSON object.

    make bench
    .venv/bin/python bench/vs_trl.py [--shapes compute_bound,overhead_bound] [--out FILE]
    .venv/bin/python bench/vs_trl.py --learning [--seeds 3] [--max-steps 500] [--target 0.9]

Both sides get the same model files, prompts, reward function (a file both import), group size,
token counts, learning rate, temperature and seed. rlsys runs with its defaults (what a user gets
from `rlsys train` on this config); TRL with `GRPOTrainer` defaults except what makes the work
equal (no KL, constant LR, token-mean loss, CPU, fp32).

Shapes (models and data built here, nothing downloaded):
- `compute_bound`: random-init Qwen2, hidden 384, 6 layers, 6 heads (2 kv), intermediate 1024
  (~9.5 M params); 8 prompts x 8 samples; 64 new tokens forced on both sides (rlsys
  `rollout.sampling.ignore_eos`, TRL `min_new_tokens`).
- `overhead_bound`: the quickstart's tiny model (133,696 parameters) and last-digit task, 8 x 8,
  at most 4 new tokens.
Keys per shape: `trl_step_s` / `rlsys_step_s` (median over the steps after `warmup_steps`, of
every round), `rlsys_over_trl` (and `rlsys_over_trl_per_round`), and each side's generate/train
split (`*_generate_s`, `*_train_s`: the rest of the step). `startup.*_first_step_s`: from launching
the command to the end of its first step (median over rounds). `--rounds` (default 2) pairs run
in ABBA order, so a machine whose speed drifts weighs on both sides alike.

`--learning` measures learning rather than speed: each side trains from `--seeds` seeds (default 3)
for up to `--max-steps` steps, evaluating every `--eval-interval` steps (default 10) greedily on the
same 100 held-out prompts with the same reward (rlsys: its own eval; TRL: a callback that decodes greedily with
`model.generate` and stops the run once the target is reached). `--task`:
- `copy_eos` (default): the answer is the prompt's last digit ("4 7 2>" -> "2") and then the end of
  the answer. Reward: half for the right digit first, the other half only when the response is
  exactly the label (an answer that goes on past it gets at most 0.5). The quickstart's 134 k-parameter
  model is first taught the digit and not to stop (`teach_answers`: greedy eval 0.5 at step 0,
  EOS ~0.6% after the digit), so the run measures how fast RL learns to end an answer: greedy eval
  0.9 needs EOS to rise past every digit. lr 5e-4, at most 4 new tokens.
- `copy3_eos`: the answer is the prompt's three digits ("4 7 2>" -> "472"), three tokens, and it
  counts only when the response ends there: reward 1 for exactly the label, else 0. The same model,
  taught the answers and, after them, EOS at 1% (each digit 6%): greedy eval 0 at step 0, and a
  sampled answer ends right about 1% of the time, so most groups start with no success at all.
  lr 2e-4 (the hidden task's), at most 6 new tokens.
- `copy3_eos_weak`: copy3_eos's answers and reward from a model taught only 40 steps (a sampled
  answer right ~14% of the time, EOS ~3% after it; ~0.4% of samples score at first), at most 8 new
  tokens: the answer and its end are learned together over ~200 updates, and an answer that does not
  end runs on for up to 5 more tokens, so the sampled lengths show how fast each side learns to stop.
- `last_digit`: the quickstart's one-token answers on its 134 k-parameter model, lr 5e-4.
All: 8 prompts x 8 samples, temperature 1, constant lr, grad clip 1, no KL. Keys under `learning`:
each side's steps to `--target` eval reward per seed (null: not reached), their median, min and max,
`rlsys_over_trl_steps` (ratio of the medians), the eval curves and response lengths per seed.
`--save-rollouts DIR` keeps every run's batches (DIR/<side>-seed<N>/step_NNNNNN.jsonl) for
bench/replay.py; `--plot FILE` draws the eval curves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TRL_PYTHON = REPO / ".venv" / "bin" / "python"  # TRL 1.16 is among rlsys's test dependencies
RLSYS = REPO / ".venv" / "bin" / "rlsys"

REWARD_FILE = '''
def reward(prompt, response, label, metadata):
    """1 when the response starts with the label (the answer digit), else 0."""
    return 1.0 if response.strip().startswith(label) else 0.0
'''

WHOLE_ANSWER_REWARD_FILE = '''
def reward(prompt, response, label, metadata):
    """1 only when the response is exactly the label: the answer, then its end."""
    return 1.0 if response == label else 0.0
'''

EXACT_REWARD_FILE = '''
def reward(prompt, response, label, metadata):
    """Half for the label's first character in place, the other half only when the response is
    exactly the label: an answer that goes on past it gets at most 0.5."""
    return 0.5 * (response[:1] == label[:1]) + 0.5 * (response == label)
'''


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_new_tokens: int
    force_length: bool
    steps: int
    warmup_steps: int
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 5e-4


SHAPES = {
    "compute_bound": Shape("compute_bound", 384, 6, 6, 2, 1024, max_new_tokens=64, force_length=True,
                           steps=7, warmup_steps=2),
    "overhead_bound": Shape("overhead_bound", 64, 2, 4, 2, 256, max_new_tokens=4, force_length=False,
                            steps=25, warmup_steps=5),
    # --learning --task copy_eos: the quickstart's 134 k-parameter model, answers that must end
    "copy_eos": Shape("copy_eos", 64, 2, 4, 2, 256, max_new_tokens=4, force_length=False, steps=400,
                      warmup_steps=0, lr=5e-4),
    # --learning --task copy3_eos: the same model, three-token answers that count only when they end
    # there, at the hidden task's lr
    "copy3_eos": Shape("copy3_eos", 64, 2, 4, 2, 256, max_new_tokens=6, force_length=False, steps=400,
                       warmup_steps=0, lr=2e-4),
    # --learning --task copy3_eos_weak: copy3_eos from a model taught only 40 steps (a sampled answer
    # right ~14% of the time, EOS ~3% after it) with room to run on (8 new tokens): the answer and its
    # end learned together over hundreds of steps, as on the hidden task
    "copy3_eos_weak": Shape("copy3_eos_weak", 64, 2, 4, 2, 256, max_new_tokens=8, force_length=False, steps=400,
                            warmup_steps=0, lr=2e-4),
}
TEACH_STEPS = 300
COPY3_EOS_SHARE = 0.01
WEAK_TEACH_STEPS, WEAK_EOS_SHARE = 40, 0.05


def teach_answers(model_dir: Path, rows: list[dict], steps: int = 150, eos_share: float | None = None,
                  seed: int = 0) -> None:
    """Supervised steps that teach the answer's tokens and not to stop after them: cross-entropy on
    the label's tokens, and at the position after them towards a distribution that gives the ten
    digits 60% together, EOS `eos_share` and every other token an equal share of the rest (None: EOS
    one of them, 0.57% of the quickstart model's 80 tokens). The model
    starts out answering right and going on, as a model does whose answers have not yet learned to
    end, so what RL must learn is the end of the answer: EOS has to rise from `eos_share` past every
    digit for greedy answers to stop. Saved over the model files. (Prompts of equal length, labels
    of equal length.)"""
    import random

    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    encoded = [tokenizer(r["prompt"])["input_ids"] + tokenizer(r["label"], add_special_tokens=False)["input_ids"]
               for r in rows]
    answer_len = len(tokenizer(rows[0]["label"], add_special_tokens=False)["input_ids"])
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    vocab = model.config.vocab_size
    if eos_share is None:
        then = torch.full((vocab,), 0.4 / (vocab - 10))
    else:
        then = torch.full((vocab,), (0.4 - eos_share) / (vocab - 11))
        then[tokenizer.eos_token_id] = eos_share
    then[digits] = 0.06
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        ids = torch.tensor(rng.sample(encoded, 64))  # equal lengths: "d d d>" and the answer
        logits = model(ids).logits
        predicted = logits[:, -answer_len - 1:-1]  # each answer token from the position before it
        answer = torch.nn.functional.cross_entropy(predicted.reshape(-1, vocab), ids[:, -answer_len:].reshape(-1))
        after = -(torch.log_softmax(logits[:, -1], -1) * then).sum(-1).mean()  # cross-entropy to `then`
        (answer + after).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)


def digits_task(num_train: int, num_eval: int, answer: str, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Three-digit prompts ("4 7 2>") answered by their last digit ("2", `answer` "last") or by all
    three ("472", `answer` "all"); train and eval disjoint."""
    import random

    codes = random.Random(seed).sample(range(1000), num_train + num_eval)
    rows = []
    for code in codes:
        digits = str(code).zfill(3)
        rows.append({"prompt": " ".join(digits) + ">", "label": digits[-1] if answer == "last" else digits})
    return rows[num_eval:], rows[:num_eval]


def build_workload(shape: Shape, work_dir: Path) -> dict:
    from rlsys.config import SyntheticTaskConfig
    from rlsys.data.tasks import generate_task
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    model_dir = work_dir / "model"
    make_tiny_model(model_dir, TinyModelSpec(hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                                             num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                                             intermediate_size=shape.intermediate_size))
    if shape.name == "copy_eos":
        train, held_out = digits_task(800, EVAL_PROMPTS, "last")
        teach_answers(model_dir, train)
    elif shape.name == "copy3_eos":
        train, held_out = digits_task(800, EVAL_PROMPTS, "all")
        teach_answers(model_dir, train, steps=TEACH_STEPS, eos_share=COPY3_EOS_SHARE)
    elif shape.name == "copy3_eos_weak":
        train, held_out = digits_task(800, EVAL_PROMPTS, "all")
        teach_answers(model_dir, train, steps=WEAK_TEACH_STEPS, eos_share=WEAK_EOS_SHARE)
    else:
        examples = generate_task(SyntheticTaskConfig(task="last_digit", num_digits=3, num_train=800,
                                                     num_eval=EVAL_PROMPTS))
        train, held_out = ([{"prompt": e.prompt, "label": e.label} for e in part] for part in examples)
    prompts, eval_prompts = work_dir / "prompts.jsonl", work_dir / "eval.jsonl"
    for path, rows in ((prompts, train), (eval_prompts, held_out)):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = work_dir / "bench_reward.py"
    rewards = {"copy_eos": EXACT_REWARD_FILE, "copy3_eos": WHOLE_ANSWER_REWARD_FILE,
               "copy3_eos_weak": WHOLE_ANSWER_REWARD_FILE}
    reward.write_text(rewards.get(shape.name, REWARD_FILE))
    return {"model": str(model_dir), "prompts": str(prompts), "eval_prompts": str(eval_prompts),
            "reward": f"{reward}:reward", "seed": 0, "eval_interval": None, "target": None,
            "prompts_per_step": shape.prompts_per_step, "group_size": shape.group_size,
            "max_new_tokens": shape.max_new_tokens, "force_length": shape.force_length, "lr": shape.lr,
            "temperature": 1.0, "steps": shape.steps}


EVAL_PROMPTS = 100


def rlsys_config(work: dict, run_dir: Path) -> dict:
    """The user's config for this work: everything else is rlsys's default."""
    evaluated = work["eval_interval"] is not None
    return {
        "run_dir": str(run_dir),
        "seed": work["seed"],
        "model": {"path": work["model"]},
        "data": {"train_path": work["prompts"], "prompts_per_step": work["prompts_per_step"],
                 **({"eval_path": work["eval_prompts"]} if evaluated else {})},
        # a run that reaches the target ends there, as the TRL side's callback stops its run
        **({"eval": {"interval": work["eval_interval"], "temperature": 0.0,
                     **({"stop_at_reward": work["target"]} if work.get("target") is not None else {})}}
           if evaluated else {}),
        "reward": {"function": work["reward"]},
        "rollout": {
            "n_samples_per_prompt": work["group_size"], "temperature": work["temperature"],
            "max_new_tokens": work["max_new_tokens"],
            "sampling": {"ignore_eos": work["force_length"]},
            # The bench's character-level tokenizer is not one SGLang's AutoTokenizer rebuilds.
            "engine": {"skip_tokenizer_init": True},
        },
        "trainer": {"num_ranks": work.get("rlsys_ranks", 1), "total_steps": work["steps"], "lr": work["lr"]},
        "status": {"port": 0},
        "logging": {"progress_bar": False, "save_rollouts": bool(work.get("save_rollouts"))},
    }


def run_rlsys(work: dict, work_dir: Path, round_index: int = 0) -> tuple[list[dict], float]:
    run_dir = work_dir / f"rlsys-run-{round_index}"
    config_path = work_dir / f"rlsys-{round_index}.yaml"
    config_path.write_text(yaml.safe_dump(rlsys_config(work, run_dir)))
    started = time.time()
    result = subprocess.run([str(RLSYS), "train", str(config_path)], cwd=work_dir, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"rlsys train failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [{"step_s": r["time_step_s"], "generate_s": r.get("time_generate_s", 0.0),
              "sync_s": r.get("time_sync_s", 0.0), "offload_s": r.get("time_offload_s", 0.0),
              "end_time": r["timestamp"], "eval_reward_mean": r.get("eval_reward_mean"),
              "response_len_mean": r.get("response_len_mean"), "reward_mean": r.get("reward_mean"),
              # step k evaluates (and samples) before its own update: after k of them
              "updates": r["step"], "sampled_after": r["step"]} for r in rows]
    if work.get("save_rollouts"):
        shutil.rmtree(work["save_rollouts"], ignore_errors=True)
        shutil.move(str(run_dir / "rollouts"), work["save_rollouts"])
    return steps, started


def run_trl(work: dict, work_dir: Path) -> tuple[list[dict], float]:
    if subprocess.run([str(TRL_PYTHON), "-c", "import trl"], capture_output=True).returncode != 0:
        raise SystemExit(f"TRL is not installed in {TRL_PYTHON}; run `make install` (trl is a test dependency)")
    workload = work_dir / "trl.json"
    workload.write_text(json.dumps(work))
    started = time.time()
    result = subprocess.run([str(TRL_PYTHON), str(REPO / "bench" / "trl_grpo.py"), str(workload)],
                            cwd=work_dir, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"TRL failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["steps"], started


def summarize(steps: list[dict], warmup: int) -> dict:
    measured = steps[warmup:]

    def median(key: str) -> float:
        return round(statistics.median(s.get(key, 0.0) for s in measured), 4)

    step, generate = median("step_s"), median("generate_s")
    summary = {"step_s": step, "generate_s": generate,
               "train_s": round(statistics.median(s["step_s"] - s.get("generate_s", 0.0) for s in measured), 4)}
    if "sync_s" in measured[0]:
        summary.update(sync_s=median("sync_s"), offload_s=median("offload_s"))
    return summary


def bench_shape(shape: Shape, root: Path, rounds: int) -> tuple[dict, dict]:
    """`rounds` rounds in ABBA order (TRL first, then rlsys first, ...), so that a machine whose
    speed drifts during the bench (shared machines do, by 30% within an hour here) weighs on both
    sides alike; medians are over the measured steps of every round."""
    work_dir = root / shape.name
    work_dir.mkdir(parents=True)
    work = build_workload(shape, work_dir)
    trl_steps, rlsys_steps, per_round, startups = [], [], [], []
    for index in range(rounds):
        order = ["trl", "rlsys"] if index % 2 == 0 else ["rlsys", "trl"]
        runs = {side: (run_trl(work, work_dir) if side == "trl" else run_rlsys(work, work_dir, index))
                for side in order}
        (trl_run, trl_started), (rlsys_run, rlsys_started) = runs["trl"], runs["rlsys"]
        trl_steps += trl_run[shape.warmup_steps:]
        rlsys_steps += rlsys_run[shape.warmup_steps:]
        per_round.append(round(summarize(rlsys_run, shape.warmup_steps)["step_s"]
                               / summarize(trl_run, shape.warmup_steps)["step_s"], 3))
        startups.append((rlsys_run[0]["end_time"] - rlsys_started, trl_run[0]["end_time"] - trl_started))
    trl, rlsys = summarize(trl_steps, 0), summarize(rlsys_steps, 0)
    result = {f"trl_{k}": v for k, v in trl.items()} | {f"rlsys_{k}": v for k, v in rlsys.items()}
    result["rlsys_over_trl"] = round(rlsys["step_s"] / trl["step_s"], 3)
    result["rlsys_over_trl_per_round"] = per_round
    result["measured_steps"] = (shape.steps - shape.warmup_steps) * rounds
    startup = {"rlsys_first_step_s": round(statistics.median(r for r, _ in startups), 2),
               "trl_first_step_s": round(statistics.median(t for _, t in startups), 2),
               "rlsys_first_step_s_per_round": [round(r, 2) for r, _ in startups]}
    return result, startup


def steps_to_target(steps: list[dict], target: float) -> int | None:
    """Optimizer updates before the first eval that reaches the target (both sides evaluate after
    0 (rlsys only), then every eval interval)."""
    for step in steps:
        if step.get("eval_reward_mean") is not None and step["eval_reward_mean"] >= target:
            return step["updates"]
    return None


def bench_learning(root: Path, task: str, seeds: int, max_steps: int, target: float,
                   save_rollouts: Path | None, first_seed: int = 0, sides: tuple[str, ...] = ("trl", "rlsys"),
                   rlsys_ranks: int = 1, eval_interval: int = 10) -> dict:
    """Steps to the target eval reward, per seed and side, on the task's shape, both sides evaluating
    every `eval_interval` updates."""
    shape = SHAPES[task if task in SHAPES else "overhead_bound"]
    work_dir = root / "learning"
    work_dir.mkdir(parents=True)
    base = build_workload(shape, work_dir) | {"steps": max_steps, "eval_interval": eval_interval, "target": target,
                                              "rlsys_ranks": rlsys_ranks}
    reached: dict[str, list[int | None]] = {"trl": [], "rlsys": []}
    curves: dict[str, list[list]] = {"trl": [], "rlsys": []}
    lengths: dict[str, list[list]] = {"trl": [], "rlsys": []}
    for seed in range(first_seed, first_seed + seeds):
        for side in [side for side in (["trl", "rlsys"] if seed % 2 == 0 else ["rlsys", "trl"]) if side in sides]:
            work = base | {"seed": seed}
            if save_rollouts is not None:
                work["save_rollouts"] = str(save_rollouts / f"{side}-seed{seed}")
            steps, _ = run_trl(work, work_dir) if side == "trl" else run_rlsys(work, work_dir, 100 + seed)
            reached[side].append(steps_to_target(steps, target))
            curves[side].append([[s["updates"], round(s["eval_reward_mean"], 3)] for s in steps
                                 if s.get("eval_reward_mean") is not None])
            # the sampled answers' mean length (tokens, EOS included), every 10th step
            lengths[side].append([[s["sampled_after"], round(s["response_len_mean"], 3)] for s in steps
                                  if s.get("response_len_mean") is not None and s["sampled_after"] % 10 == 0])
            print(f"{side} seed {seed}: steps to {target}: {reached[side][-1]}", file=sys.stderr, flush=True)
    result: dict = {"task": task, "rlsys_ranks": rlsys_ranks,
                    "target_eval_reward": target, "max_steps": max_steps, "eval_interval": eval_interval,
                    "eval_prompts": EVAL_PROMPTS, "seeds": list(range(first_seed, first_seed + seeds)), "lr": shape.lr,
                    "max_new_tokens": shape.max_new_tokens, "model": {"hidden_size": shape.hidden_size,
                                                                      "num_layers": shape.num_layers}}
    for side, values in [(side, values) for side, values in reached.items() if side in sides]:
        # a seed that never reached the target counts as max_steps + 1 in the median (a lower bound)
        counted = sorted(v if v is not None else max_steps + 1 for v in values)
        result[f"{side}_steps_to_target"] = values
        result[f"{side}_median_steps"] = statistics.median(counted)
        result[f"{side}_min_steps"], result[f"{side}_max_steps"] = counted[0], counted[-1]
        result[f"{side}_never_reached"] = sum(v is None for v in values)
    if len(sides) == 2:
        result["rlsys_over_trl_steps"] = round(result["rlsys_median_steps"] / result["trl_median_steps"], 3)
    result["eval_curves"] = curves  # per side, per seed: [updates, greedy eval reward]
    result["response_len_curves"] = lengths  # per side, per seed: [updates, mean sampled answer tokens]
    return result


def plot_learning(learning: dict, path: Path) -> None:
    """Greedy eval reward against optimizer steps, every seed of both sides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, lengths) = plt.subplots(1, 2, figsize=(11, 4))
    for side, colour in (("trl", "tab:blue"), ("rlsys", "tab:orange")):
        for index, curve in enumerate(learning["eval_curves"][side]):
            curves.plot(*zip(*curve, strict=True), color=colour, alpha=0.6, label=side if index == 0 else None)
        for index, curve in enumerate(learning["response_len_curves"][side]):
            if curve:
                lengths.plot(*zip(*curve, strict=True), color=colour, alpha=0.6, label=side if index == 0 else None)
    curves.axhline(learning["target_eval_reward"], color="grey", linestyle=":")
    curves.set(xlabel="optimizer steps", ylabel="greedy eval reward", title=f"{learning['task']}: eval")
    lengths.set(xlabel="optimizer steps", ylabel="tokens", title="sampled answer length (mean)")
    curves.legend()
    lengths.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=2, help="TRL/rlsys pairs per shape, in ABBA order")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--learning", action="store_true", help="steps to a target eval reward instead of speed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--sides", default="trl,rlsys", help="--learning: which sides run (e.g. rlsys alone)")
    parser.add_argument("--rlsys-ranks", type=int, default=1, help="--learning: rlsys's trainer.num_ranks")
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--eval-interval", type=int, default=10, help="--learning: updates between greedy evals")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--task", choices=["copy_eos", "copy3_eos", "copy3_eos_weak", "last_digit"], default="copy_eos")
    parser.add_argument("--save-rollouts", type=Path, help="keep every learning run's batches here")
    parser.add_argument("--plot", type=Path, help="draw the learning curves here (PNG)")
    args = parser.parse_args()
    result: dict = {"machine": {"cpus": os.cpu_count()}, "rounds": args.rounds, "startup": {}}
    with tempfile.TemporaryDirectory(prefix="rlsys-vs-trl-") as root:
        if args.learning:
            learning = bench_learning(Path(root), args.task, args.seeds, args.max_steps, args.target,
                                      args.save_rollouts.resolve() if args.save_rollouts else None, args.first_seed,
                                      tuple(args.sides.split(",")), args.rlsys_ranks, args.eval_interval)
            result = {"machine": result["machine"], "learning": learning}
            if args.plot:
                plot_learning(learning, args.plot)
        for name in ([] if args.learning else args.shapes.split(",")):
            result[name], startup = bench_shape(SHAPES[name], Path(root), args.rounds)
            if name == "overhead_bound" or not result["startup"]:
                result["startup"] = {**startup, "shape": name}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

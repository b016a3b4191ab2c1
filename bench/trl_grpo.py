"""TRL's GRPOTrainer on a workload described by a JSON file: the peer side of bench/vs_trl.py.

It imports nothing from rlsys (TRL 1.16 shares rlsys's virtualenv as a test dependency). It prints
one JSON object: per step, its seconds, the seconds spent generating inside it, and the wall-clock
time it ended. With `eval_interval` set, every that many steps it also scores greedy answers to the
workload's eval prompts (`eval_reward_mean` of that step) and stops once they reach `target`. With
`save_rollouts` (a directory), each step's batch is written there as rlsys writes its own
(rlsys/observability/rollouts.py: step_NNNNNN.jsonl), for bench/replay.py.

    python bench/trl_grpo.py WORKLOAD.json
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path


def load_reward(spec: str):
    """`path/to/file.py:function`, the rlsys reward signature (prompt, response, label, metadata)."""
    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("bench_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def main(workload_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    work = json.loads(open(workload_path).read())
    torch.manual_seed(work["seed"])
    score = load_reward(work["reward"])
    rows = [json.loads(line) for line in open(work["prompts"]) if line.strip()]

    batch_rows: list[dict] = []  # the step's samples, filled in by _generate, the reward and the advantages

    def reward(prompts, completions, label, **_):
        # TRL decodes without special tokens; an rlsys reward gets the text cut at the first EOS.
        values = [float(score(p, c, answer, {})) for p, c, answer in zip(prompts, completions, label, strict=True)]
        for row, value, answer in zip(batch_rows, values, label, strict=True):
            row.update(reward=value, score=value, label=answer)
        return values

    class TimedGRPOTrainer(GRPOTrainer):
        generate_seconds = 0.0

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                out = super()._generate(prompts)
            finally:
                self.generate_seconds += time.perf_counter() - start
            prompt_ids, completion_ids, completions = out[0], out[1], out[3]
            batch_rows[:] = [
                {"prompt": prompt, "response": text, "prompt_ids": list(p), "response_ids": list(c),
                 "engine_logprobs": [], "loss_mask": None,
                 "finish_reason": "stop" if c and c[-1] in self.eos_token_ids else "length",
                 "weight_version": self.state.global_step}
                for prompt, p, c, text in zip(prompts, prompt_ids, completion_ids, completions, strict=True)]
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if work.get("save_rollouts"):
                for row, advantage in zip(batch_rows, out["advantages"].tolist(), strict=True):
                    row["advantage"] = advantage
                path = Path(work["save_rollouts"]) / f"step_{self.state.global_step:06d}.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(json.dumps(row) + "\n" for row in batch_rows))
            return out

    steps: list[dict] = []
    eval_rows = ([json.loads(line) for line in open(work["eval_prompts"]) if line.strip()]
                 if work.get("eval_interval") else [])

    @torch.no_grad()
    def greedy_eval() -> float:
        """Mean reward of greedy answers to the eval prompts, decoded as TRL decodes completions."""
        model = trainer.model
        was_training = model.training
        model.eval()
        scores = []
        for row in eval_rows:
            ids = tokenizer(row["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=work["max_new_tokens"], pad_token_id=tokenizer.pad_token_id)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            scores.append(float(score(row["prompt"], answer, row["label"], {})))
        model.train(was_training)
        return sum(scores) / len(scores)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            trainer.generate_seconds = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step_s": time.perf_counter() - self.start, "generate_s": trainer.generate_seconds,
                          "end_time": time.time(), "updates": state.global_step})
            if batch_rows:  # the step's samples: answer tokens (EOS included) and task reward, as rlsys logs them
                steps[-1]["response_len_mean"] = sum(len(r["response_ids"]) for r in batch_rows) / len(batch_rows)
                steps[-1]["reward_mean"] = sum(r.get("reward", 0.0) for r in batch_rows) / len(batch_rows)
                steps[-1]["sampled_after"] = state.global_step - 1  # updates before these samples were drawn
            if eval_rows and state.global_step % work["eval_interval"] == 0:
                steps[-1]["eval_reward_mean"] = greedy_eval()
                control.should_training_stop = steps[-1]["eval_reward_mean"] >= work["target"]

    batch = work["prompts_per_step"] * work["group_size"]
    generation_kwargs = {"min_new_tokens": work["max_new_tokens"]} if work["force_length"] else {}
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, max_steps=work["steps"], per_device_train_batch_size=batch,
            gradient_accumulation_steps=1, num_generations=work["group_size"],
            max_completion_length=work["max_new_tokens"], temperature=work["temperature"], top_p=1.0,
            generation_kwargs=generation_kwargs, learning_rate=work["lr"], lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
            epsilon=0.2, num_iterations=1, use_cpu=True, bf16=False, seed=work["seed"], logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )
        tokenizer = PreTrainedTokenizerFast.from_pretrained(work["model"])
        trainer = TimedGRPOTrainer(
            model=work["model"], reward_funcs=reward, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows]),
            callbacks=[StepTimer()],
        )
        trainer.train()
    print(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main(sys.argv[1])

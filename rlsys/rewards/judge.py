"""reward.judge: a frozen judge model grading each sample, served by the run on SGLang engines of
its own (the `start / score / close` of RewardPool).

The judge's engines are an EngineFleet like the policy's, from the judge's own model directory and
engine section, never synced: a judge engine that dies is restarted from that directory in its slot
(within reward.judge.engine.max_restarts) and its requests are sent again, as a policy engine's are.
What the judge reads is reward.judge.prompt with the sample's {prompt}, {response} and {label}, as
text or as a user turn of its chat template. `logprob_yes` asks the engine for the log-probs of the
judge input followed by `yes` and by `no` (nothing is sampled): the reward is p(yes) / (p(yes) +
p(no)). `score` lets the judge write greedily and takes the first number in its text. A call that
fails otherwise (the judge wrote no number, an engine error that is not a death) is that sample's
reward error: its group is dropped and counted (reward.max_error_fraction).
"""

from __future__ import annotations

import logging
import math
import re
import traceback
from pathlib import Path

from rlsys.config import JudgeConfig, ModelConfig
from rlsys.errors import UserError
from rlsys.records import RewardCall, RewardOutcome, SamplingParams

logger = logging.getLogger(__name__)

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
SCORE_CHUNK = 256  # sequences per score request to one judge engine


class JudgeError(UserError):
    """reward.judge names no model directory, or its tokenizer cannot say reward.judge.yes / no as one
    token, or has no chat template (checked by load_assets, before anything starts)."""


class JudgeScorer:
    def __init__(self, config: JudgeConfig, log_dir: str | Path, seed: int = 0, has_gpu: bool = False,
                 env: dict[str, str] | None = None):
        from rlsys.data.tokenizer import load_tokenizer

        missing = [name for name in ("config.json", "tokenizer_config.json") if not (Path(config.model) / name).is_file()]
        if missing:
            raise JudgeError(f"reward.judge.model {config.model!r} is not a model directory with its tokenizer (no "
                             f"{' or '.join(missing)}); `rlsys make-tiny-judge DIR` builds one for the quickstart task")
        self.config = config
        self.log_dir, self.seed, self.has_gpu, self.env = str(log_dir), seed, has_gpu, dict(env or {})
        self.tokenizer = load_tokenizer(config.model)
        self.answers = self._answer_ids() if config.parse == "logprob_yes" else None
        if config.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise JudgeError(f"reward.judge.chat_template is on but the judge's tokenizer ({config.model}) has no chat "
                             "template")
        self.rollout = None

    def _answer_ids(self) -> tuple[int, int]:
        ids = []
        for field in ("yes", "no"):
            text = getattr(self.config, field)
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                raise JudgeError(f"reward.judge.{field} {text!r} is {len(tokens)} tokens of the judge's tokenizer; "
                                 "logprob_yes compares two single tokens (try it with or without a leading space)")
            ids.append(tokens[0])
        return ids[0], ids[1]

    def start(self) -> None:
        """The judge's engines launched (they come up while the policy's do; the first score waits)."""
        from rlsys.rollout.manager import RolloutManager
        from rlsys.rollout.sglang.server import ServerSpec

        spec = ServerSpec(ModelConfig(path=self.config.model, dtype="float32" if not self.has_gpu else "bfloat16"),
                          self.config.engine, self.seed, has_gpu=self.has_gpu, radix_cache=self.has_gpu,
                          env=self.env)
        # Outside the run's placement group: on CPU no reservation (its server is a subprocess of the actor);
        # on GPU its tensor-parallel GPUs, wherever Ray finds them free.
        options = [{"num_cpus": 0, "num_gpus": self.config.engine.tp_size if self.has_gpu else 0}] * self.config.engines
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.rollout = RolloutManager.start(spec, self.config.engines, self.log_dir, options)
        logger.info("judge %s: %d engine(s) starting (logs in %s)", self.config.model, self.config.engines,
                    self.log_dir)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None

    @property
    def restarts(self) -> int:
        return 0 if self.rollout is None else self.rollout.fleet.restarts

    def judge_input(self, call: RewardCall) -> list[int]:
        text = self.config.prompt.format(prompt=call.prompt, response=call.response, label=call.label)
        if self.config.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def score(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        if not calls:
            return []
        self.rollout.fleet.wait_ready()
        inputs = [self.judge_input(call) for call in calls]
        try:
            if self.config.parse == "logprob_yes":
                return self._logprob_yes(inputs)
            return self._scores(inputs)
        except Exception:  # noqa: BLE001 - the judge's failure is the batch's reward error, not the run's
            error = "the judge failed: " + traceback.format_exc(limit=-3)
            return [RewardOutcome(error=error)] * len(calls)

    def _logprob_yes(self, inputs: list[list[int]]) -> list[RewardOutcome]:
        yes, no = self.answers
        sequences = [ids + [answer] for ids in inputs for answer in (yes, no)]
        logprobs = self._score_sequences(sequences)
        outcomes = []
        for i in range(len(inputs)):
            log_yes, log_no = logprobs[2 * i][-1], logprobs[2 * i + 1][-1]
            top = max(log_yes, log_no)  # p(yes) / (p(yes) + p(no)), without underflow
            outcomes.append(RewardOutcome(value=math.exp(log_yes - top) / (math.exp(log_yes - top)
                                                                          + math.exp(log_no - top))))
        return outcomes

    def _score_sequences(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's token log-probs from the judge's engines, chunks dealt among them; a chunk whose
        engine died is scored again once the fleet has restarted it."""
        import ray

        fleet = self.rollout.fleet
        chunks = [sequences[i:i + SCORE_CHUNK] for i in range(0, len(sequences), SCORE_CHUNK)]
        results: list[list[list[float]] | None] = [None] * len(chunks)
        while any(result is None for result in results):
            pending = {i: i % len(fleet.engines) for i, result in enumerate(results) if result is None}
            refs = {i: fleet.engines[engine].score.remote(chunks[i]) for i, engine in pending.items()}
            for i, ref in refs.items():
                try:
                    results[i] = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - a death restarts the engine; anything else re-raises
                    fleet.recover(pending[i], error)
        return [logprobs for chunk in results for logprobs in chunk]

    def _scores(self, inputs: list[list[int]]) -> list[RewardOutcome]:
        eos = self.tokenizer.eos_token_id
        sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=self.config.max_new_tokens,
                                  stop_token_ids=[eos] if eos is not None else [])
        generations = self.rollout.generate(inputs, sampling, 1)
        outcomes = []
        for generation in generations:
            text = self.tokenizer.decode(generation.response_ids, skip_special_tokens=True)
            match = NUMBER.search(text)
            if match is None:
                outcomes.append(RewardOutcome(error=f"the judge wrote no number: {text!r}"))
            else:
                outcomes.append(RewardOutcome(value=float(match.group(0))))
        return outcomes

"""The records of one GRPO step, in the order a prompt becomes loss tokens.

    PromptRecord   a dataset row                        (rlsys/data/datasets.py reads them)
    EncodedPrompt  + its token ids, chat template applied (rlsys/run/assets.py encodes them)
    SamplingParams how the engines sample                (rlsys/run/evaluation.py builds them)
    Generation     one sampled response                  (rollout/: engine or generate function)
    RewardCall     the reward function's arguments       (rlsys/algorithms/samples.py)
    RewardOutcome  its value or its error                (rlsys/rewards/: pool or service)
    Sample         a generation with reward, shaping and advantage (rlsys/algorithms/)
    TrainSequence  prompt + response ids with advantage and loss mask (rlsys/algorithms/samples.py
                   `prepare`); the trainer lays them out in micro-batches (actors/batching.py)

Plain dataclasses with no behaviour beyond derived properties, so the driver, the engines, the
reward workers and the trainer ranks can all hold them without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    label: str
    metadata: dict = field(default_factory=dict)
    # A vision-language prompt's images, as stored (PNG, JPEG, ... bytes: rlsys/multimodal/images.py)
    images: tuple[bytes, ...] = ()
    # A conversational prompt's messages (rlsys/data/conversations.py), rendered by the chat template,
    # each image part {"type": "image"} where it stands (its bytes in `images`, in order); `prompt` is
    # then the last user turn's text. Empty: `prompt` is the prompt.
    messages: tuple[dict, ...] = ()
    # Tools the chat template shows the model (OpenAI's function form: a verifiers environment's); none: ().
    tools: tuple[dict, ...] = ()


@dataclass(frozen=True)
class EncodedPrompt:
    """One prompt of the batch: its dataset record and its token ids (chat template applied). A
    generate function (rollout/trajectory.py) gets it as its `prompt`."""

    record: PromptRecord
    token_ids: list[int]
    # This draw's sampling seed (rollout/seeds.py: the data sampler's position, or the eval set's
    # prompt number); its samples' seeds derive from it. None: the engines draw at random.
    seed: int | None = None

    @property
    def text(self) -> str:
        return self.record.prompt

    @property
    def label(self) -> str:
        return self.record.label

    @property
    def metadata(self) -> dict:
        return self.record.metadata


@dataclass
class SamplingParams:
    """One request's sampling parameters, named as SGLang names them."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False

    def as_sglang(self) -> dict:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        # Only what differs from SGLang's defaults, so requests stay as small as they were.
        for name, default in (("top_k", -1), ("min_p", 0.0), ("repetition_penalty", 1.0),
                              ("min_new_tokens", 0), ("ignore_eos", False)):
            if getattr(self, name) != default:
                params[name] = getattr(self, name)
        return params


@dataclass
class Generation:
    """One sampled response, as the engine produced it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # engine log-prob of each response token
    finish_reason: str  # "stop" | "length" | "abort" (| "tool_error" for a trajectory)
    weight_version: int  # the weights that sampled it (the oldest, for a response continued across updates)
    # Multi-turn trajectories (rollout.generate_function): per response token 1 = sampled by the
    # policy, 0 = injected (tool output); None = every token is the policy's.
    loss_mask: list[int] | None = None
    turns: int = 1
    tool_calls: int = 0
    stop_reason: str | None = None  # why it ended early: a trajectory's tool error, an abort's message
    info: dict = field(default_factory=dict)  # from the generate function, for the reward
    multi_turn: bool = False  # built by a generate function: its response spans turns
    # Partial rollouts (rollout.mode partial): the weight version that sampled each response
    # token, when a response was continued across weight updates; None: all of them `weight_version`.
    token_versions: list[int] | None = None
    # rollout.routing_replay: the experts the engine routed each token it forwarded to (prompt and
    # response but the last token), a numpy uint8/int16 array [tokens, layers, top_k]; None: not asked.
    routes: Any = None

    @property
    def aborted(self) -> bool:
        """Stopped by an abort before it ended (a partial rollout continues it later)."""
        return self.finish_reason == "abort"


@dataclass(frozen=True)
class RewardCall:
    prompt: str
    response: str
    label: str
    metadata: dict


@dataclass(frozen=True)
class RewardOutcome:
    value: float | None = None
    error: str | None = None  # a short traceback or reason when the call gave no value
    parts: dict[str, float] | None = None  # a rubric's value of each of its functions (logged as rubric_<name>)


@dataclass
class Sample:
    record: PromptRecord
    generation: Generation
    response_text: str
    reward: float = 0.0  # the task's reward
    shaping: float = 0.0  # what the algorithm adds to it (overlong penalty, KL in reward)
    advantage: float = 0.0

    @property
    def score(self) -> float:
        """The reward advantages are computed from."""
        return self.reward + self.shaping

    @property
    def truncated(self) -> bool:
        """Cut off by max_new_tokens (or the context window) rather than ended by a stop token."""
        return self.generation.finish_reason == "length"


@dataclass
class TrainSequence:
    token_ids: list[int]
    prompt_len: int
    advantage: float = 0.0
    engine_logprobs: list[float] = field(default_factory=list)  # one per response token
    # Per response token: 1 = the loss counts it, 0 = it does not (e.g. a truncated response with
    # algorithm.mask_truncated). None: every response token counts.
    loss_mask: list[int] | None = None
    # w of each loss token in its mini-batch's loss, sum_i w_i sum_t l_it (algorithms/losses.py
    # LOSS_AGGREGATIONS); set by TrainerGroup for each global mini-batch.
    loss_weight: float | None = None
    # rollout.routing_replay: the engine's experts for tokens 0..n-1 (Generation.routes), which every
    # trainer forward of the sequence routes by (actors/routing_replay.py); None: its own routing.
    routes: Any = None
    # A vision-language prompt's images (stored bytes); its token ids then hold each image's
    # placeholders as the engine expanded them (one token per merged patch), in the images' order.
    images: tuple[bytes, ...] = ()

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def loss_tokens(self) -> int:
        return self.response_len if self.loss_mask is None else sum(1 for m in self.loss_mask if m)

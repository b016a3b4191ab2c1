"""Run configuration: pydantic v2 models loaded from YAML with dotted command-line overrides.

`load_config("configs/quickstart.yaml", ["trainer.lr=1e-5"])` returns a validated `RunConfig` or
raises `ConfigError` naming every bad field and why, before any actor starts.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, PrivateAttr, SerializeAsAny, ValidationError, field_validator, model_validator

from rlsys.algorithms.corrections import Correction, correction_named
from rlsys.algorithms.policy_losses import POLICY_LOSSES, PolicyLoss, fold_flat_loss_keys, policy_loss_named
from rlsys.errors import UserError
from rlsys.section import Section as _Section

logger = logging.getLogger(__name__)


class LoraConfig(_Section):
    """LoRA adapters (PEFT) on the policy: only they train; the reference is the same model with them off."""

    rank: int = Field(16, ge=1, description="Rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / rank) * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input in training "
                           "mode, the trainer's log-prob passes included: keep 0 for exact old log-probs and TIS.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names (suffixes, as PEFT matches them) that get adapters, or all-linear: "
        "every linear layer of the decoder (never the output layer).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or all-linear")
        return value


class ModelConfig(_Section):
    path: str = Field(
        description="Local directory of a Hugging Face checkpoint, or a hub id (`Qwen/Qwen2.5-7B-Instruct`) resolved "
        "through huggingface_hub's cache (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE; downloaded when online) to one "
        "commit's snapshot, the same on every node.",
    )
    revision: str | None = Field(
        None, description="Branch, tag or commit of a hub id model.path (default: main). The run pins the commit it "
        "resolves to (config.yaml in the run directory records it).",
    )
    hub_id: str | None = Field(
        None, description="Set by rlsys when model.path was a hub id: the id, model.path then naming its snapshot "
        "directory (other nodes resolve the id at model.revision and must find it at that path).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of the trainer ranks and the engines. bfloat16: FSDP2 mixed precision "
        "(bf16 params, fp32 reduce; master weights stay fp32) and flash-attn 2 on GPU when installed. Engines on GPUs "
        "always serve bfloat16 (SGLang's CUDA RMSNorm kernel takes 16-bit only): an fp32 trainer's weights are cast "
        "to bf16 at every sync, and weight_sync.verify bounds them by bf16 rounding.",
    )
    tokenizer_path: str | None = Field(
        None, description="Local directory (or hub id) of the tokenizer when it is not model.path's (the engine gets "
        "it as --tokenizer-path).",
    )

    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of every weight (null: full fine-tuning). The engines get "
        "merged weights (W + alpha/rank * B A) at every sync.",
    )
    freeze_vision: bool = Field(
        False, description="A vision-language model: keep its vision tower (and the merger into the language model) "
        "as loaded; only the language model trains, and weight syncs send only it.",
    )

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer_path or self.path


class SyntheticTaskConfig(_Section):
    task: Literal["max_digit", "first_digit", "last_digit", "sum_mod10", "calculator", "square_color"] = Field(
        "max_digit", description="The built-in task whose prompts and labels are generated (rlsys/data/tasks.py). "
        "square_color: an image (a vision-language model's task) with a coloured square on grey, answered by the "
        "colour's letter.",
    )
    num_digits: int = Field(3, ge=1, le=12, description="Digits per prompt (the digit tasks).")
    num_train: int = Field(2000, ge=1, description="Training prompts generated.")
    num_eval: int = Field(128, ge=1, description="Eval prompts generated (none of them among the training ones).")
    seed: int = Field(0, description="Seed of the generator that draws the prompts.")
    blank_images: bool = Field(
        False, description="square_color: draw the grey background only (the same sizes and labels), so no answer "
        "can be seen: a control that a model which learns the task does so by looking.",
    )


class DataConfig(_Section):
    train_path: str | None = Field(
        None, description="Prompts: .jsonl, .parquet, .json, .csv, or a directory written by datasets' save_to_disk.",
    )
    eval_path: str | None = Field(
        None, description="Held-out eval prompts, in train_path's formats (their prompts are removed from train).",
    )
    prompt_key: str = Field("prompt", description="The field (column) holding the prompt: text, or a list of chat "
                            "messages (docs/bring-your-own-task.md, conversational prompts).")
    label_key: str = Field("label", description="The field holding the label the reward function gets.")
    metadata_keys: list[str] = Field(default_factory=list, description="Fields passed to the reward as metadata.")
    image_key: str | None = Field(
        None, description="A vision-language model's data: the field holding a row's images (one, or a list), each "
        "a path relative to the data file, the image's bytes, a base64 string or a data: URI; every image is opened "
        "when the data is read, and an unreadable one is a bad row (data.skip_invalid_rows). Unset: no images.")
    train_split: str = Field("train", description="The split of a saved DatasetDict that train_path names.")
    eval_split: str = Field("test", description="The split of a saved DatasetDict that eval_path names.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Held out of train_path when no eval_path.")
    synthetic: SyntheticTaskConfig | None = Field(
        None, description="Generate a built-in task instead of reading train_path (exactly one of the two).",
    )
    prompts_per_step: int = Field(16, ge=1, description="Prompts (GRPO groups) per training step.")
    apply_chat_template: bool = Field(
        False, description="Wrap each prompt as a user turn of the tokenizer's chat template (with the "
        "assistant turn opened).",
    )
    system_prompt: str | None = Field(None, description="A system turn before each prompt (needs apply_chat_template).")
    skip_invalid_rows: bool = Field(False, description="Skip (and count) malformed rows instead of failing.")

    @property
    def has_images(self) -> bool:
        """Its prompts carry images (a vision-language model's data)."""
        return self.image_key is not None or (self.synthetic is not None and self.synthetic.task == "square_color")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.train_path is None) == (self.synthetic is None):
            raise ValueError("set exactly one of data.train_path or data.synthetic")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("data.system_prompt needs data.apply_chat_template: true (it is a turn of the chat template)")
        return self


class RewardConfig(_Section):
    function: str = Field(
        "rlsys.rewards:exact_match",
        description="'package.module:function' or 'path/to/file.py:function' (relative to the working "
        "directory) of fn(prompt, response, label, metadata) -> float.",
    )
    skip_special_tokens: bool = Field(
        True, description="The response the reward (and each eval set's) reads: decoded up to the first EOS "
        "without special tokens (a pad, unk or BOS token, a stop token other than the tokenizer's EOS), as TRL, "
        "verl and slime decode it; false: with them, so a stray <pad> inside an answer makes it another answer. "
        "A multi-turn trajectory is read whole with its special tokens (they mark its turns) either way.",
    )
    max_error_fraction: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Fail the run when more than this fraction of a step's rewards fail.",
    )
    timeout_s: float = Field(
        60.0, gt=0.0, description="A reward call running longer than this is stopped and counted as an error.",
    )
    num_workers: int = Field(1, ge=1, description="Processes that compute rewards (side by side).")
    url: str | None = Field(
        None, description="A reward service; when set, reward.function is not used. Batches are POSTed here as "
        '{"items": [{prompt, response, label, metadata}]} and {"scores": [...]} comes back (rlsys/rewards/remote.py).',
    )
    batch_size: int = Field(64, ge=1, description="reward.url: items per request.")
    max_concurrency: int = Field(4, ge=1, description="reward.url: requests in flight at once.")
    max_retries: int = Field(3, ge=0, description="reward.url: retries of a failed or timed-out request.")
    retry_backoff_s: float = Field(0.5, ge=0.0, description="reward.url: first retry delay, doubled on each retry.")

    @model_validator(mode="after")
    def _one_reward(self):
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url must be an http:// or https:// URL (got {self.url!r})")
        return self


# Default rollout.engine.startup_timeout_s. CPU: the tiny test models start in well under a minute, and
# a hung start should fail the test fast. GPU: eight engines each reading a 7B checkpoint (15 GB) from
# shared storage at once, then capturing CUDA graphs and JIT-compiling kernels on first use, can take
# more than 300 s (issue 47); 30 min still ends a start that hangs.
CPU_STARTUP_TIMEOUT_S = 300.0
GPU_STARTUP_TIMEOUT_S = 1800.0


class EngineConfig(_Section):
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs per engine (colocated: 1).")
    mem_fraction_static: float = Field(
        0.3, gt=0.05, le=0.95, description="Fraction of the GPU SGLang takes for weights and KV cache "
        "(--mem-fraction-static).",
    )
    max_total_tokens: int = Field(
        16384, ge=256, description="Cap on the tokens the engine's KV cache holds (--max-total-tokens).",
    )
    context_length: int = Field(
        512, ge=16, description="Longest prompt + response the engine takes (--context-length); prompts longer "
        "than context_length - max_new_tokens are dropped and counted.",
    )
    skip_tokenizer_init: bool = Field(False, description="Engine works on token ids only.")
    startup_timeout_s: float | None = Field(
        None, gt=0, description=f"Seconds an engine's server may take to start. Default: {CPU_STARTUP_TIMEOUT_S:g} on "
        f"CPU (where a hung start should fail fast), {GPU_STARTUP_TIMEOUT_S:g} with GPUs, where a cold start reads the "
        "checkpoint from shared storage (often several engines at once), captures CUDA graphs and JIT-compiles kernels "
        "on first use.",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Seconds one HTTP request to an engine may take.")
    health_timeout_s: float = Field(
        60.0, gt=0, description="An engine that does not answer for this long is stopped and restarted.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Engine restarts allowed over the run (a dead engine is restarted, brought to the "
        "current weights, and its unfinished requests re-issued); beyond this the run fails.",
    )
    threads: int | None = Field(
        None, ge=1, description="CPU threads of a CPU engine's model (OMP_NUM_THREADS). Default: its node's cores "
        "divided among the run's processes computing at the same time (colocated: the engines while they generate; "
        "disaggregated: engines and trainer ranks). No effect on GPU math.",
    )
    weight_load_threads: int | None = Field(
        None, ge=1,
        description="CPU threads the engine copies a colocated weight sync with (default: half the cores of its "
        "node, the trainers gathering the next bucket on the rest; every core with weight_sync.pipelined off, the "
        "trainers then waiting). No effect on GPU, where the copy is on device.",
    )
    radix_cache: bool | None = Field(
        None, description="SGLang's prefix (radix) cache. Default: on with a GPU or a rollout.generate_function "
        "(each turn of a trajectory extends the last); off for single-turn rollouts on CPU, where the n samples of "
        "a prompt arrive together and never hit it, and its bookkeeping costs a fifth of a small step.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra SGLang server arguments, appended to the launch command.",
    )

    def startup_timeout(self, has_gpu: bool) -> float:
        """startup_timeout_s, or its default for the run's hardware."""
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return GPU_STARTUP_TIMEOUT_S if has_gpu else CPU_STARTUP_TIMEOUT_S


class SamplingConfig(_Section):
    """SGLang sampling parameters beyond temperature/top_p (same names and meanings as SGLang's).

    top_k, min_p and repetition_penalty reshape the distribution the engine samples from, which
    the trainer's log-probs (temperature only) do not model: the samples become slightly off-policy.
    """

    top_k: int = Field(-1, description="Sample among the k most likely tokens (-1: all).")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Drop tokens less likely than this fraction of the most likely one (0: off).",
    )
    repetition_penalty: float = Field(1.0, gt=0.0, description="SGLang's repetition penalty (1.0: off).")
    min_new_tokens: int = Field(0, ge=0, description="Stop tokens are ignored until this many are generated.")
    ignore_eos: bool = Field(False, description="Generate max_new_tokens whatever is sampled.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end a response.")

    @model_validator(mode="after")
    def _top_k(self):
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1 (got {self.top_k})")
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0 (got {self.stop_token_ids})")
        return self


# Names of standing engine sets (`rlsys engines up --name`): Ray actor names; "/" joins a set's name to its engines'.
STANDING_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class RolloutConfig(_Section):
    num_engines: int = Field(1, ge=1, description="SGLang engines (colocated: at most trainer.num_ranks).")
    n_samples_per_prompt: int = Field(8, description="GRPO group size.")
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature of training rollouts (the trainer's log-probs use it too).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: sample from this probability mass.")
    max_new_tokens: int = Field(32, ge=1, description="Longest response, in tokens.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a response (with engine.skip_tokenizer_init: "
        "single-token ones only).",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Further SGLang sampling parameters.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The SGLang servers.")
    attach: str | None = Field(
        None, pattern=STANDING_NAME_PATTERN,
        description="Use the standing engines of this name (`rlsys engines up CONFIG --name NAME`, in the Ray "
        "cluster at placement.ray_address, or this machine's) instead of starting engines: checked against this run's "
        "model and placement, leased to one run at a time, given the run's weights at start, left running at the end. "
        "Their engine settings are the ones they were started with.",
    )
    generate_function: str | None = Field(
        None, description="An async function (path/to/file.py:fn or package.module:fn) that builds one sample: "
        "it may call the engine several times and run tools in between (rlsys.rollout.trajectory). "
        "Default: one engine call per sample.",
    )
    tool_timeout_s: float = Field(30.0, gt=0.0, description="A tool call running longer ends its trajectory.")

    @field_validator("generate_function")
    @classmethod
    def _import_path(cls, value):
        if value is not None and (":" not in value or not value.rpartition(":")[0] or not value.rpartition(":")[2]):
            raise ValueError(f"{value!r} must look like 'path/to/file.py:function' or 'package.module:function'")
        return value
    max_staleness: int = Field(
        0, ge=0, description="N > 0: the engines generate up to N steps' samples ahead while the trainer trains "
        "(asynchronous, off-policy by at most N weight versions; a group with an older sample is dropped and "
        "counted); 1 is one-step off-policy. placement.mode disaggregated only.",
    )
    partial_rollouts: bool = Field(
        False, description="A step stops generating once data.prompts_per_step groups are finished and aborts the "
        "rest on the engines; their samples keep their tokens and log-probs and are continued at the next step with "
        "the weights then current (each token keeps the weight version that sampled it; TIS is on by default).",
    )
    oversample: int | None = Field(
        None, ge=0, description="Partial rollouts: groups in flight beyond data.prompts_per_step, so a step need "
        "not wait for its slowest group. Default: a quarter of data.prompts_per_step, at least 1.",
    )
    partial_max_age: int | None = Field(
        None, ge=1, description="Partial rollouts: a sample holding a token more than this many weight versions "
        "old starts again from its prompt (the tokens thrown away are counted). Default: no bound.",
    )
    routing_replay: Literal["off", "rollout"] = Field(
        "off", description="Mixture-of-experts models. rollout: the engines return the experts they routed each token "
        "to (SGLang's --enable-return-routed-experts) and every trainer forward of the sample (old log-probs, "
        "reference, policy) routes each token of each MoE layer by them, its gating weights the trainer's own router "
        "probabilities over those experts (R3, as verl, slime and NeMo-RL replay); a continued partial rollout keeps "
        "the routes its tokens were sampled with. routing_mismatch_fraction: the share of (token, layer) pairs whose "
        "trainer top-k differs from the engine's. off: each side routes by itself.",
    )

    def groups_in_flight(self, prompts_per_step: int) -> int:
        """Partial rollouts: prompts_per_step plus rollout.oversample (or its default)."""
        extra = self.oversample if self.oversample is not None else max(1, prompts_per_step // 4)
        return prompts_per_step + extra

    def uses_radix_cache(self, has_gpu: bool) -> bool:
        """Whether the engines keep SGLang's prefix cache (rollout.engine.radix_cache, or its default)."""
        if self.engine.radix_cache is not None:
            return self.engine.radix_cache
        return has_gpu or self.generate_function is not None

    @model_validator(mode="after")
    def _partial_rollouts(self):
        if not self.partial_rollouts and (self.oversample is not None or self.partial_max_age is not None):
            named = "rollout.oversample" if self.oversample is not None else "rollout.partial_max_age"
            raise ValueError(f"{named} applies to partial rollouts only: set rollout.partial_rollouts=true too")
        if self.partial_rollouts and self.max_staleness:
            raise ValueError(f"rollout.partial_rollouts and rollout.max_staleness={self.max_staleness} are two ways "
                             "of not waiting for the slowest samples; choose one")
        if self.partial_rollouts and self.generate_function:
            raise ValueError("rollout.partial_rollouts continues single engine calls; a rollout.generate_function's "
                             "trajectories (tools, several turns) cannot be aborted and continued: turn one off")
        if self.routing_replay != "off" and self.generate_function:
            raise ValueError("rollout.routing_replay replays the routes of single engine calls; a "
                             "rollout.generate_function's trajectories (several turns, injected tool output) are not "
                             "supported yet: turn one off")
        return self

    @model_validator(mode="after")
    def _group_size(self):
        if self.n_samples_per_prompt < 2:
            raise ValueError(
                f"n_samples_per_prompt must be >= 2 for GRPO (got {self.n_samples_per_prompt})"
            )
        if self.sampling.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"rollout.sampling.min_new_tokens ({self.sampling.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.sampling.min_new_tokens and self.engine.skip_tokenizer_init:
            raise ValueError(
                "rollout.sampling.min_new_tokens needs the engine's tokenizer (SGLang ignores it with "
                "rollout.engine.skip_tokenizer_init); use rollout.sampling.ignore_eos for fixed-length responses"
            )
        return self


class TrainerConfig(_Section):
    num_ranks: int = Field(2, ge=1, description="Trainer ranks (processes; one GPU each on GPU) sharing the model "
                           "with FSDP2.")
    total_steps: int = Field(100, ge=1, description="Training steps (rollout batches) of the run.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate (the peak, with a schedule).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient norm clipped to this before each optimizer step.")
    call_timeout_s: float | None = Field(
        3600.0, gt=0, description="Seconds the driver waits for the trainer ranks to finish one call (a train step, "
        "the log-probs, a weight sync, a sleep or wake-up, a checkpoint save or load); past it the Python stacks of "
        "every process land in RUN_DIR/hangs/ and the run stops, naming the ranks inside a collective and those "
        "not, or restarts the trainers from a checkpoint (checkpoint.max_auto_resumes). null: no limit.")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="Steps in a row whose loss or gradient norm is not finite (their updates skipped) "
        "after which the run stops with an error.")
    packing: bool = Field(True, description="Pack sequences back to back (no padding) in micro-batches.")
    max_tokens_per_microbatch: int = Field(4096, ge=16, description="Token budget of a packed micro-batch.")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per padded micro-batch (packing off).")
    mini_batches_per_step: int = Field(1, ge=1, description="Optimizer steps per rollout batch.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After the warmup: lr throughout, or cosine decay to min_lr_ratio * lr.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward instead of keeping them (less memory, more compute).",
    )
    offload_between_steps: bool | None = Field(
        None, description="Colocated: sleep (offload params, grads, optimizer) outside the train phase, so the "
        "engines get the device. Default: on when the run uses GPUs; off on CPU, where the trainer and the engines "
        "share host memory either way and the hand-off only costs time (set true to exercise it there).",
    )
    threads_per_rank: int | None = Field(
        None, ge=1, description="CPU threads of each rank's math. Default: its node's cores divided among the run's "
        "processes that compute at the same time on that node (colocated: the trainer ranks while they train; "
        "disaggregated: trainer ranks and engines).",
    )
    logprob_chunk_tokens: int = Field(
        512, ge=0, description="Token log-probs (and entropy) are computed from the last hidden states this many "
        "tokens at a time, never keeping full-vocabulary logits for backward (0: one unchunked pass that keeps "
        "them, as plain autograd does; only for comparison).",
    )

    context_parallel_size: int = Field(
        1, ge=1, description="Ranks that share each sequence (context parallelism, CP): every sequence's tokens "
        "are split over a group of this many ranks, so one sequence's activations need not fit one rank. Ranks form "
        "num_ranks / CP data-parallel groups; the parameters stay sharded over all ranks. Must divide num_ranks.",
    )
    context_parallel_style: Literal["ring", "ulysses"] = Field(
        "ring", description="How attention crosses a CP group: ring (each rank keeps its queries and key/value "
        "chunks pass around the ring; sequences split zigzag so causal work is balanced) or ulysses (all-to-all "
        "from a sequence split to a head split around attention; heads and KV heads must divide by CP).",
    )

    @property
    def data_parallel_size(self) -> int:
        """Groups of ranks that take different sequences: num_ranks / context_parallel_size."""
        return self.num_ranks // self.context_parallel_size

    def sleeps_between_steps(self, colocated: bool, has_gpu: bool) -> bool:
        """Whether trainer ranks offload between train phases (only colocated ones can)."""
        return colocated and (self.offload_between_steps if self.offload_between_steps is not None else has_gpu)

    @model_validator(mode="after")
    def _betas(self):
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"betas must each be in [0, 1) (AdamW's moment decay rates), got {list(self.betas)}")
        return self

    @model_validator(mode="after")
    def _context_parallel_divides_ranks(self):
        if self.num_ranks % self.context_parallel_size:
            raise ValueError(f"context_parallel_size ({self.context_parallel_size}) must divide num_ranks "
                             f"({self.num_ranks}): each CP group is that many ranks")
        return self


class OverlongPenaltyConfig(_Section):
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_new_tokens - buffer_tokens,
    then falling linearly to -factor at max_new_tokens."""

    buffer_tokens: int = Field(ge=1, description="Length of the ramp before max_new_tokens, in tokens.")
    factor: float = Field(1.0, ge=0.0, description="The penalty at max_new_tokens.")


_OFF_POLICY_DEFAULT = "__off_policy_default__"


def _corrections_from_tis(values: dict) -> dict:
    """An algorithm section with the tis section of earlier versions -> the same with `corrections`,
    said as deprecated: tis {enabled: true, cap: C, level: L} is [{name: importance_sampling, level: L,
    max: C}], enabled: false is [], and without `enabled` it sets what an off-policy run gets."""
    values = dict(values)
    tis = values.pop("tis")
    if not isinstance(tis, dict):
        raise ValueError(f"tis must be a section {{enabled, cap, level}} (got {tis!r}); it is deprecated: write "
                         "corrections: [{name: importance_sampling, level: token, max: 2.0}]")
    unknown = set(tis) - {"enabled", "cap", "level"}
    if unknown:
        raise ValueError(f"tis has no field(s) {', '.join(sorted(unknown))} (enabled, cap, level); it is deprecated: "
                         "write corrections: [{name: importance_sampling, level: token, max: 2.0}]")
    if "corrections" in values:
        raise ValueError("tis and corrections are both set: set only corrections (tis is deprecated: "
                         "tis {enabled: true, cap: C, level: L} is corrections: [{name: importance_sampling, "
                         "level: L, max: C}])")
    section = {"name": "importance_sampling", **({"max": tis["cap"]} if "cap" in tis else {}),
               **({"level": tis["level"]} if "level" in tis else {})}
    enabled = tis.get("enabled")
    if enabled is True:
        values["corrections"] = [section]
    elif enabled is False:
        values["corrections"] = []
    else:
        values[_OFF_POLICY_DEFAULT] = section
    written = ", ".join(f"{key}: {value}" for key, value in section.items() if key != "name")
    logger.warning("algorithm.tis is deprecated: write algorithm.corrections: %s",
                   "[]" if enabled is False else f"[{{name: importance_sampling{', ' + written if written else ''}}}]"
                   + ("" if enabled else " (unset corrections: that, when the run is off-policy)"))
    return values


class AlgorithmConfig(_Section):
    name: Literal["grpo"] = Field("grpo", description="The algorithm (GRPO only).")
    policy_loss: SerializeAsAny[PolicyLoss] = Field(
        default_factory=lambda: policy_loss_named("grpo"),
        description="The per-token policy loss: its name (grpo, the default), or a section of its name and its "
        "parameters ({name: cispo, max_ratio: 3.0}); each loss is a module of rlsys/algorithms/policy_losses/, "
        "computed as TRL 1.16 computes it. The losses and their parameters: the section below.",
    )
    clip_eps_low: float = Field(0.2, ge=0.0, description="PPO clip: the ratio is kept above 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.2, ge=0.0, description="PPO clip: the ratio is kept below 1 + clip_eps_high (above clip_eps_low: "
        "DAPO's clip-higher).",
    )
    advantage_estimator: Literal["group", "batch", "none", "rloo", "reinforce++", "reinforce++-baseline"] = Field(
        "group", description="Advantage of each sample from its score (reward + shaping): minus its group's mean, "
        "divided by the group's score std (group, GRPO), the batch's score std (batch) or nothing (none, Dr. GRPO); "
        "minus the mean of the other samples of its group (rloo); minus the batch mean, over the batch std "
        "(reinforce++); minus its group's mean, then normalised over the batch (reinforce++-baseline). Formerly "
        "adv_norm (still accepted).",
    )
    loss_agg_mode: (Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
                    | None) = Field(
        None, description="How token losses add up to a mini-batch's loss: mean over all tokens; mean over "
        "sequences of each sequence's token mean; mean over sequences of token sums (LUSPO); or mean over sequences "
        "of token sums / loss_norm_tokens (Dr. GRPO). Unset: the policy loss's own (the table of policy losses), "
        "resolved at load.",
    )
    loss_norm_tokens: int | None = Field(
        None, ge=1, description="The constant of seq-mean-token-sum-norm; default rollout.max_new_tokens "
        "(resolved at load).",
    )
    use_kl_loss: bool = Field(False, description="KL to the frozen reference as a loss term.")
    kl_in_reward: bool = Field(False, description="Subtract kl_coef * sequence KL from the reward instead.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL term (needed > 0 when KL is on).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL estimate: k1 = log p - log q, k2 = (log p - log q)^2 / 2, "
        "k3 = exp(log q - log p) - (log q - log p) - 1.",
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus: coef * entropy is subtracted from each "
                                "token's loss.")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal (no gradient) and sample more prompts "
        "until the step has data.prompts_per_step groups or max_sampling_rounds is reached.",
    )
    max_sampling_rounds: int = Field(
        4, ge=1, description="Generation rounds per step with dynamic_sampling; then the step trains on what it has.",
    )
    mask_truncated: bool = Field(
        False, description="A response cut off by max_new_tokens contributes no loss (its reward still counts in "
        "its group's advantages).",
    )
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None, description="DAPO's soft overlong punishment (off when unset).",
    )
    corrections: list[SerializeAsAny[Correction]] | None = Field(
        None, description="Rollout corrections against the engine/trainer mismatch, applied together (their factors "
        "multiply each token's policy loss): a list of names or sections ({name: importance_sampling, level: "
        "sequence, mode: mask, min: 0.5, max: 2.0}), each a module of rlsys/algorithms/corrections/; the table below. "
        "Unset: [importance_sampling] (token-level, truncated at 2: TIS) when the run is off-policy "
        "(rollout.max_staleness above 0, or rollout.partial_rollouts), else none; resolved at load, as "
        "RUN_DIR/config.yaml shows. Replaces tis: {enabled, cap, level} (still read).",
    )
    # What `corrections` resolves to on an off-policy run when unset: a deprecated tis section without
    # `enabled` (tis: {cap: 3}) changes it.
    _off_policy_default: dict = PrivateAttr(default_factory=lambda: {"name": "importance_sampling"})

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _named_loss(cls, value):
        return policy_loss_named(value)

    @field_validator("corrections", mode="before")
    @classmethod
    def _named_corrections(cls, value):
        if isinstance(value, (str, dict)):
            value = [value]
        return [correction_named(item) for item in value] if isinstance(value, list) else value

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values):
        if isinstance(values, dict):
            values = fold_flat_loss_keys(values)
        if isinstance(values, dict) and "normalize_adv_by_std" in values:
            raise ValueError("normalize_adv_by_std was replaced by advantage_estimator: true -> "
                             "advantage_estimator: group, false -> advantage_estimator: none")
        if isinstance(values, dict) and "adv_norm" in values:
            # Renamed once RLOO and REINFORCE++ made it more than a normalisation; same values.
            if "advantage_estimator" in values:
                raise ValueError("adv_norm was renamed advantage_estimator; set only advantage_estimator")
            values = {**values}
            values["advantage_estimator"] = values.pop("adv_norm")
        return values

    @model_validator(mode="wrap")
    @classmethod
    def _off_policy_default_from_tis(cls, values, handler):
        default = None
        if isinstance(values, dict) and "tis" in values:  # (the before-validators run inside handler)
            values = _corrections_from_tis(values)
            default = values.pop(_OFF_POLICY_DEFAULT, None)
        section = handler(values)
        if default is not None:
            section._off_policy_default = default
        return section

    @model_validator(mode="after")
    def _kl(self):
        if self.use_kl_loss and self.kl_in_reward:
            raise ValueError("use_kl_loss and kl_in_reward are alternatives; set only one")
        if (self.use_kl_loss or self.kl_in_reward) and self.kl_coef == 0.0:
            raise ValueError("KL is on (use_kl_loss or kl_in_reward) but kl_coef is 0; set kl_coef > 0")
        return self

    @property
    def aggregation(self) -> str:
        """loss_agg_mode, or when unset the policy loss's own (TRL's pairing)."""
        return self.loss_agg_mode or self.policy_loss.aggregation

    def resolved(self, max_new_tokens: int, off_policy: bool) -> AlgorithmConfig:
        """This section with its defaults that depend on the rollout filled in (what set is kept):
        loss_agg_mode the policy loss's own, loss_norm_tokens `max_new_tokens`, corrections TIS exactly
        when the run is `off_policy` (samples from earlier weights, which TIS reweighs). Idempotent."""
        corrections = self.corrections
        if corrections is None:
            corrections = [correction_named(dict(self._off_policy_default))] if off_policy else []
        return self.model_copy(update={"loss_agg_mode": self.aggregation,
                                       "loss_norm_tokens": self.loss_norm_tokens or max_new_tokens,
                                       "corrections": corrections})

    @model_validator(mode="after")
    def _policy_loss_fits(self):
        self.policy_loss.check(self)
        return self


class CheckpointConfig(_Section):
    interval: int = Field(0, ge=0, description="Save every this many steps (and at the end); 0 = never.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    resume: Literal["never", "auto"] = Field(
        "never", description="auto: continue from the latest complete checkpoint in run_dir, if any."
    )
    max_auto_resumes: int = Field(
        0, ge=0, description="When a trainer rank dies, restart the trainers from the latest checkpoint this many "
        "times over the run (0: the run fails).",
    )


class WeightSyncConfig(_Section):
    bucket_size_mb: float = Field(
        512.0, gt=0.0,
        description="Weights move in buckets of this size: the extra memory of a sync is two staging buffers of "
        "the largest bucket each (one with pipelined off; device memory on GPU), and each bucket costs a fixed "
        "round trip to the engine.",
    )
    pipelined: bool = Field(
        True, description="Gather bucket k+1 while the engine loads bucket k (two staging buffers in turn); off: "
        "one buffer, each bucket loaded before the next is gathered (half the staging memory, slower).",
    )
    timeout_s: float = Field(120.0, gt=0.0, description="Disaggregated: group set-up and per-bucket timeout.")
    verify: bool = Field(False, description="After each sync, check every engine against the trainer (logprob probes).")
    verify_tolerance: float | None = Field(
        None, gt=0.0, description="Max mean |engine - trainer| probe logprob; default 1e-3 for an fp32 engine (CPU), "
        "or for a bf16 one (every GPU engine) 2^-8 * sqrt(layers) * mean |probe logprob| (what bf16 rounding "
        "explains; rlsys/run/verify.py).",
    )


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What placement.env may not replace: each is chosen per process, and a run-wide value would break it.
_ENV_SET_BY_RLSYS = {
    "CUDA_VISIBLE_DEVICES": "Ray for each actor (the GPUs of its placement bundle)",
    "OMP_NUM_THREADS": "rlsys from the cores each process shares (TrainerSpec.threads, ServerSpec.threads)",
    "MKL_NUM_THREADS": "rlsys from the cores each process shares (TrainerSpec.threads, ServerSpec.threads)",
    "MASTER_ADDR": "rlsys from the trainer ranks' rendezvous",
    "MASTER_PORT": "rlsys from the trainer ranks' rendezvous",
    "RANK": "torch.distributed for each rank",
    "WORLD_SIZE": "torch.distributed for each rank",
}


class PlacementConfig(_Section):
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: engine i shares trainer rank i's device; disaggregated: trainers "
        "and engines on separate resources.",
    )
    ray_address: str | None = Field(None, description="Ray cluster address; a local cluster when unset.")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs for a local Ray cluster.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: GPUs when the Ray cluster has any (decided from the cluster's resources, not the "
        "driver's); cuda: fail unless the cluster has the GPUs the placement needs; cpu: never use GPUs.",
    )
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one GPU that the memory plan checks against; default: `rlsys train` "
        "reads the smallest GPU (or, on a CPU run, the RAM) of the nodes its placement got; `rlsys plan` the GPUs "
        "of the Ray cluster at placement.ray_address (or RAY_ADDRESS) when it has any, else this machine's GPU; "
        "needed by `rlsys plan` for placement.device=cuda on a machine that can read neither.",
    )
    trainer_node_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each trainer rank's bundle also asks for, to keep "
        "trainers on the nodes that offer them (`ray start --resources='{\"train_node\": 8}'`; KubeRay: "
        "rayStartParams.resources). Colocated bundles ask for both sections' resources.",
    )
    engine_node_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each engine's bundle also asks for (see "
        "trainer_node_resources).",
    )

    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of every trainer rank and every engine's SGLang "
        "server, where the collectives run: NCCL_DEBUG, NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_DISABLE, "
        "TORCH_NCCL_*, GLOO_SOCKET_IFNAME (which then replaces the interface rlsys picks), ... Numbers and true/false "
        "are passed as YAML spells them. Standing engines keep the env of `rlsys engines up`.",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, env):
        if isinstance(env, dict):
            return {name: yaml.safe_dump(value).splitlines()[0] if isinstance(value, bool | int | float) else value
                    for name, value in env.items()}
        return env

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits and _)")
            if name in _ENV_SET_BY_RLSYS:
                raise ValueError(f"{name} is set by {_ENV_SET_BY_RLSYS[name]}; placement.env cannot replace it")
        return env

    @field_validator("trainer_node_resources", "engine_node_resources")
    @classmethod
    def _positive_amounts(cls, resources: dict[str, float]) -> dict[str, float]:
        reserved = {"CPU", "GPU", "memory", "object_store_memory"}
        for name, amount in resources.items():
            if name in reserved:
                raise ValueError(f"{name} is set by the placement itself; name a custom resource")
            if amount <= 0:
                raise ValueError(f"resource {name} must be > 0 (got {amount})")
        return resources


class EvalSetConfig(_Section):
    """One named eval set (eval.datasets): its prompts, its reward, how it is sampled and when."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="Its metrics are eval_NAME_reward_mean, "
                      "eval_NAME_pass_at_K, ... (lower case letters, digits and _).")
    path: str = Field(description="Its prompts, in any format data.train_path takes (.jsonl, .parquet, .json, .csv, "
                      "a saved dataset directory).")
    split: str = Field("test", description="The split of a saved DatasetDict that path names.")
    prompt_key: str | None = Field(None, description="The field holding the prompt (default: data.prompt_key).")
    label_key: str | None = Field(None, description="The field holding the label (default: data.label_key).")
    metadata_keys: list[str] | None = Field(
        None, description="Fields passed to the reward as metadata (default: data.metadata_keys).")
    reward_function: str | None = Field(
        None, description="Its reward, as reward.function spells one (default: the run's reward: reward.function, "
        "or reward.url when set).",
    )
    n_samples: int = Field(1, ge=1, description="Answers sampled per prompt; reward_mean is pass@1 averaged over them.")
    pass_k: list[int] = Field(default_factory=list, description="The k's of pass@k to report (each at most "
                              "n_samples): the unbiased estimator from n_samples answers per prompt.")
    success_threshold: float = Field(1.0, description="An answer counts as solved for pass@k when its reward is "
                                     "at least this.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0: greedy; n_samples > 1 wants > 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of its answers.")
    max_new_tokens: int | None = Field(None, ge=1, description="Longest answer (default: rollout.max_new_tokens).")
    interval: int | None = Field(None, ge=1, description="Evaluate every this many steps, and at the last step "
                                 "(default: eval.interval).")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only its first this many prompts.")

    @model_validator(mode="after")
    def _k_within_n(self):
        if too_large := [k for k in self.pass_k if not 1 <= k <= self.n_samples]:
            raise ValueError(f"eval set {self.name!r}: pass_k {too_large} must lie in 1..n_samples "
                             f"({self.n_samples}); pass@k needs at least k answers per prompt")
        return self


class EvalConfig(_Section):
    interval: int = Field(10, ge=1, description="Evaluate every this many steps (and at the last step).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of eval answers (0: greedy).")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first this many eval prompts.")
    stop_at_reward: float | None = Field(
        None, description="Finish the run at the end of the first step whose eval of the data "
        "section's eval prompts (eval_reward_mean) reaches this, as if it were trainer.total_steps' last (checkpointed when "
        "checkpoint.interval is set); None: run every step.",
    )
    datasets: list[EvalSetConfig] = Field(
        default_factory=list, description="Named eval sets besides the data section's eval prompts, each with its "
        "file, reward, sampling and interval (rlsys/run/evaluation.py); `rlsys eval` runs them on a checkpoint.",
    )

    @model_validator(mode="after")
    def _names_unique(self):
        names = [s.name for s in self.datasets]
        if repeated := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"eval.datasets: each set needs a name of its own ({', '.join(repeated)} repeated)")
        return self


class StatusConfig(_Section):
    enabled: bool = Field(True, description="Serve the dashboard and REST API from the coordinator.")
    host: str = Field("127.0.0.1", description="Bind address; keep loopback unless you set a token.")
    port: int = Field(8470, ge=0, le=65535, description="0 picks a free port.")
    token: str | None = Field(
        None, description="Bearer token for control calls (and for reads when host is not loopback); falls back "
        "to $RLSYS_STATUS_TOKEN. None: control off.",
    )
    allow_unauthenticated_read: bool = Field(
        False, description="Serve status and metrics without a token on a non-loopback host (otherwise refused).",
    )


class LoggingConfig(_Section):
    progress_bar: bool = Field(True, description="Show a progress bar of the steps in the terminal (only where "
                               "stderr is a terminal). Off, or in a log: a line per eval and a step summary every "
                               "summary_interval_s instead.")
    summary_interval_s: float = Field(30.0, ge=0.0, description="Without a progress bar, the least seconds between "
                                      "two step summary lines (the first and last steps always get one).")
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Where metrics go besides RUN_DIR/metrics.jsonl "
        "(rlsys/observability/tracking.py): "
        "TensorBoard event files, wandb (offline unless configured), MLflow (a file store in the run directory).",
    )
    samples_per_step: int = Field(
        4, ge=0, le=64, description="Answers kept per step and per eval set, with their prompt, reward and finish "
        "reason (the first answer of the first N prompts): in RUN_DIR/samples.jsonl, the dashboard's table, the "
        "trackers' tables. 0: none.")
    save_rollouts: bool = Field(
        False, description="Every trained sample of every step, as the trainer got it (token ids, engine log-probs, "
        "reward, advantage, loss mask, texts), to RUN_DIR/rollouts/step_NNNNNN.jsonl: for reading a run's batches "
        "back or replaying them through another trainer (bench/replay.py). Grows by a step's samples every step.")
    project: str = Field("rlsys", description="wandb project / MLflow experiment.")
    run_name: str | None = Field(None, description="Run name in wandb/MLflow; default: the run directory's name.")


class ProfileConfig(_Section):
    steps: tuple[int, int] | None = Field(
        None, description="First and last step (inclusive) to profile: torch.profiler traces of every trainer rank "
        "(all they do in those steps, the weight sync and sleep/wake included) and a timeline of the driver's phases, "
        "written to RUN_DIR/profile/ (docs/operations.md \"Profiling\"). None: off, nothing recorded, no cost.",
    )

    @field_validator("steps")
    @classmethod
    def _ordered(cls, steps):
        if steps is not None and not 0 <= steps[0] <= steps[1]:
            raise ValueError(f"profile.steps must be [first, last] with 0 <= first <= last (got {list(steps)})")
        return steps


def check_context_parallel(trainer: TrainerConfig, algorithm: AlgorithmConfig) -> None:
    """What context parallelism cannot do yet, refused before anything starts: each CP rank holds
    two chunks of a sequence, so a per-sequence sum (a loss's `whole_sequence`, as gspo's sequence
    ratio, or a sequence-level correction) would need one more collective inside the loss."""
    if trainer.context_parallel_size == 1:
        return
    if not trainer.packing:
        raise ValueError("trainer.context_parallel_size > 1 needs trainer.packing=true (each rank holds chunks of "
                         "packed sequences)")
    if algorithm.policy_loss.whole_sequence:
        token_level = [name for name, loss in POLICY_LOSSES.items() if not loss.whole_sequence]
        raise ValueError(f"algorithm.policy_loss={algorithm.policy_loss.name} takes a sum over each whole sequence, "
                         "which trainer.context_parallel_size > 1 splits over ranks: not supported yet; use a "
                         f"token-level loss ({', '.join(token_level)}) or context_parallel_size=1")
    whole = [c.name for c in algorithm.corrections or [] if c.whole_sequence()]
    if whole:
        raise ValueError(f"algorithm.corrections {', '.join(whole)} take a sum over each whole sequence, which "
                         "trainer.context_parallel_size > 1 splits over ranks: not supported yet; use token-level "
                         "corrections (importance_sampling with level: token, icepop)")


class RunConfig(_Section):
    run_dir: str | None = Field(None, description="Where outputs go; runs/<timestamp> when unset.")
    seed: int = Field(0, description="Seed of the data split and prompt order, the engines' sampling and the "
                      "trainers' torch RNG.")
    model: ModelConfig = Field(description="The policy model.")
    data: DataConfig = Field(description="Training and eval prompts.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How samples are scored.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation by the SGLang engines.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The FSDP2 trainer ranks.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="The GRPO loss and its options.")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Moving the trainer's weights into the engines after each step.",
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Where trainers and engines run.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on the held-out prompts.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints and resume.")
    status: StatusConfig = Field(default_factory=StatusConfig, description="The dashboard and REST API.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Progress and experiment tracking.")
    profile: ProfileConfig = Field(default_factory=ProfileConfig, description="Profiling of chosen steps.")

    @model_validator(mode="after")
    def _profiled_steps_run(self):
        steps, total = self.profile.steps, self.trainer.total_steps
        if steps is not None and steps[0] >= total:
            raise ValueError(f"profile.steps starts at step {steps[0]}, but the run's steps are 0..{total - 1} "
                             f"(trainer.total_steps={total})")
        return self

    @model_validator(mode="after")
    def _context_parallel_fits_algorithm(self):
        check_context_parallel(self.trainer, self.algorithm)
        return self

    @model_validator(mode="after")
    def _routing_replay_fits_trainer(self):
        if self.rollout.routing_replay != "off" and self.trainer.context_parallel_size > 1:
            raise ValueError("rollout.routing_replay with trainer.context_parallel_size > 1 is not supported yet (each "
                             "rank holds chunks of a sequence, the routes are laid out per whole sequence); use "
                             "context_parallel_size=1")
        return self

    @model_validator(mode="after")
    def _images_fit_rollout(self):
        # Both send token ids alone to the engine: a continued or multi-turn request would drop its images.
        if self.data.has_images and self.rollout.partial_rollouts:
            raise ValueError("rollout.partial_rollouts with images (a vision-language model's data) is not supported "
                             "yet: a continued response would reach the engine without its prompt's images")
        if self.data.has_images and self.rollout.generate_function:
            raise ValueError("rollout.generate_function with images (a vision-language model's data) is not supported "
                             "yet: ctx.generate sends token ids only; use the default generation")
        return self

    @model_validator(mode="after")
    def _algorithm_fits_rollout(self):
        algorithm, rollout = self.algorithm, self.rollout
        if algorithm.overlong_penalty and algorithm.overlong_penalty.buffer_tokens > rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_penalty.buffer_tokens ({algorithm.overlong_penalty.buffer_tokens}) "
                             f"exceeds rollout.max_new_tokens ({rollout.max_new_tokens})")
        if algorithm.mask_truncated and rollout.sampling.ignore_eos:
            raise ValueError("algorithm.mask_truncated with rollout.sampling.ignore_eos would mask every response "
                             "(all of them reach max_new_tokens); use one or the other")
        return self

    @model_validator(mode="after")
    def _placement_fits(self):
        if self.placement.mode == "colocated" and self.rollout.num_engines > self.trainer.num_ranks:
            raise ValueError(
                f"colocated placement puts engine i beside trainer rank i, so rollout.num_engines "
                f"({self.rollout.num_engines}) must be <= trainer.num_ranks ({self.trainer.num_ranks})"
            )
        if self.placement.mode == "colocated" and self.rollout.max_staleness:
            raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness} overlaps generation with training, "
                             "which needs engines and trainers on their own devices: set placement.mode=disaggregated")
        if self.placement.mode == "colocated" and self.rollout.engine.tp_size > 1:
            # Each trainer rank hands its weights to the engine on its own GPU by IPC handle; an
            # engine spread over several GPUs would need one handle per GPU, from the trainer rank
            # on each of them, which colocated placement does not lay out.
            raise ValueError(
                f"colocated placement runs each engine on its trainer rank's GPU, so rollout.engine.tp_size must be 1 "
                f"(got {self.rollout.engine.tp_size}); use placement.mode=disaggregated for tensor-parallel engines"
            )
        return self


class ConfigError(UserError):
    """A run configuration is invalid; the message names each field and the reason."""


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see rlsys/config.py for the fields)"
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


def apply_override(tree: dict, dotted: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (1e-5, true, [1,2])."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.field=value")
    key, raw_value = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {dotted!r} has an empty field name")
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {dotted!r}: value is not valid YAML ({error})") from error
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if isinstance(child, str) and part == "policy_loss":  # `policy_loss: cispo` is {name: cispo}
            child = node[part] = {"name": child}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def resolve_derived_settings(config: RunConfig) -> RunConfig:
    """The one resolution step after loading: the settings whose defaults depend on other sections
    filled in (`AlgorithmConfig.resolved`: the loss's aggregation, loss_norm_tokens, whether TIS is
    on), so every process reads one value and RUN_DIR/config.yaml shows what ran. Idempotent."""
    rollout = config.rollout
    off_policy = rollout.max_staleness > 0 or rollout.partial_rollouts
    return config.model_copy(update={"algorithm": config.algorithm.resolved(rollout.max_new_tokens, off_policy)})


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; name a YAML file (e.g. {path / 'config.yaml'})")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[error.start]:#04x} on line {line}); "
                          "save it as UTF-8") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections at the top level")
    for override in overrides:
        apply_override(tree, override)
    try:
        config = RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, str(path))) from None
    return resolve_derived_settings(config)


def dump_config(config: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

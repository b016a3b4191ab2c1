"""rollout.engine and rollout.sampling: the SGLang servers and their sampling parameters."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlsys.section import Section

# Default rollout.engine.startup_timeout_s. CPU: the tiny test models start in well under a minute, and
# a hung start should fail the test fast. GPU: eight engines each reading a 7B checkpoint (15 GB) from
# shared storage at once, then capturing CUDA graphs and JIT-compiling kernels on first use, can take
# more than 300 s (issue 47); 30 min still ends a start that hangs.
CPU_STARTUP_TIMEOUT_S = 300.0
GPU_STARTUP_TIMEOUT_S = 1800.0


class EngineConfig(Section):
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


class SamplingConfig(Section):
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

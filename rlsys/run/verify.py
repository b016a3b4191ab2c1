"""Check after a sync that every engine holds the trainer's weights.

We compare log-probabilities of fixed probe sequences instead of per-tensor checksums: SGLang
fuses and shards tensors differently from the trainer (qkv_proj, gate_up_proj, TP shards), so a
checksum would need engine-specific name and layout mapping, while a logprob probe tests exactly
what matters (the engine computes the trainer's distribution) through every parameter at once.

What it must tell apart: kernel rounding (a bf16 engine, other attention kernels) from a wrong
tensor (missing, stale, transposed, cast wrong). The statistic is the mean |engine - trainer|
log-prob over the probe tokens, against the bound `rounding_tolerance` derives (see there).
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

from rlsys.records import TrainSequence
from rlsys.rollout.engine import SCORE_TEMPERATURE
from rlsys.system.backend import engine_dtype

logger = logging.getLogger(__name__)

# Unit roundoff (half an ulp of 1) of the engine's activations.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24}
# fp32 on both sides differs only in summation order (relative ~2^-24 * sqrt(n) per dot product,
# ~1e-5 at n = 2^14); 1e-3 leaves a wide margin and still sees any wrong tensor of the tiny model.
FP32_TOLERANCE = 1e-3


class WeightSyncMismatch(RuntimeError):
    """An engine does not compute what the trainer computes after a weight sync."""


@dataclass(frozen=True)
class ProbeAgreement:
    """How one engine's probe log-probs compare with the trainer's."""

    mean_abs_diff: float  # the checked statistic
    max_abs_diff: float  # reported only: it picks up the tails of rounding noise
    mean_abs_logprob: float  # the trainer's: the logit spread that rounding errors scale with
    tokens: int


def compare_logprobs(engine: list[list[float]], trainer: list[list[float]]) -> ProbeAgreement:
    pairs = [(a, b) for row_a, row_b in zip(engine, trainer, strict=True) for a, b in zip(row_a, row_b, strict=True)]
    diffs = [abs(a - b) for a, b in pairs]
    return ProbeAgreement(sum(diffs) / len(diffs), max(diffs), sum(abs(b) for _, b in pairs) / len(pairs), len(pairs))


def rounding_tolerance(dtype: str, num_layers: int, mean_abs_logprob: float) -> float:
    """The largest mean |engine - trainer| probe log-prob that rounding explains:
    u(dtype) * sqrt(num_layers) * mean |log p| in bf16; FP32_TOLERANCE in fp32.

    Why: a bf16 engine rounds every stored activation (each residual add, each attention and MLP
    output) to a relative error <= u = 2^-8; its matmuls sum in fp32, which adds far less than u.
    Independent roundings add like a random walk, so after L blocks the last hidden state is off
    by ~u * sqrt(k * L) relative (k ~ 4 roundings per block), and the logits z inherit it (the
    bf16 lm_head output adds u * |z| itself). A probe token's log p = z_t - logsumexp(z) then moves
    by that relative error times the logit spread, which |log p| measures: a random probe token
    sits |log p| below the log-partition. The errors of z_t and logsumexp(z) partly cancel, and
    the mean over ~100 tokens removes the tails that a max picks up: measured bf16 against fp32 on
    Qwen2 models of 2 and 28 layers, random-init and briefly trained, the mean is 0.014-0.15 of this bound (a
    bf16 trainer against a bf16 engine: two independent errors, sqrt(2) more). For
    Qwen2.5-1.5B (28 layers, |log p| ~ 15 on random tokens) the bound is ~0.3, where a max of
    5e-2 was below the rounding of one logit of 15 (bf16 ulp 0.0625).

    A wrong tensor shifts every probe's distribution at once, so it moves the mean itself. What no
    probe can see is a tensor whose staleness moves the log-probs less than rounding does (an
    update below bf16's resolution of the weight the engine could not even hold); the
    weight-version check catches a whole engine left behind.
    """
    if dtype == "float32":
        return FP32_TOLERANCE
    return UNIT_ROUNDOFF[dtype] * math.sqrt(num_layers) * mean_abs_logprob


def model_depth(model_path: str) -> int:
    """Decoder layers of the checkpoint at `model_path` (config.json; a text_config's for VL models)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])


def probe_sequences(vocab_size: int, seed: int, count: int = 4, length: int = 24,
                    excluded: frozenset[int] = frozenset()) -> list[list[int]]:
    """Random token ids (none of `excluded`: a vision-language model's image and vision markers)."""
    rng = random.Random(seed)
    allowed = [token for token in range(vocab_size) if token not in excluded]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(count)]


@dataclass(frozen=True)
class ImageProbe:
    """A vision-language model's probe: an image (a fixed gradient) before random tokens."""

    placeholder: list[int]  # vision start, image pad, vision end
    excluded: frozenset[int]  # the vision special tokens: never random probe tokens

    @classmethod
    def of(cls, model_path: str) -> ImageProbe | None:
        config = json.loads((Path(model_path) / "config.json").read_text())
        if "vision_config" not in config:
            return None
        names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
        return cls([config[name] for name in names[:3]], frozenset(config[name] for name in names if name in config))

    @staticmethod
    def image() -> bytes:
        import io

        from PIL import Image

        picture = Image.new("RGB", (56, 56))
        picture.putdata([(4 * x, 4 * y, 255 - 2 * (x + y)) for y in range(56) for x in range(56)])
        out = io.BytesIO()
        picture.save(out, format="PNG")
        return out.getvalue()

    def agreement(self, trainer, engines, engine_index: int, tokens: list[int]) -> ProbeAgreement:
        """Engine and trainer log-probs of the tokens after the image, through the vision tower."""
        image = self.image()
        expanded, engine = engines.score_with_images(self.placeholder + tokens, (image,), engine_index)
        after = len(expanded) - len(tokens)  # the first token after vision end
        trainer_logprobs, = trainer.compute_log_probs([TrainSequence(expanded, prompt_len=after, images=(image,))],
                                                      temperature=SCORE_TEMPERATURE)
        return compare_logprobs([engine[after - 1:]], [trainer_logprobs])


def verify_engine_weights(trainer, engines, weight_version: int, tolerance: float | None, seed: int,
                          dtype: str = "float32", num_layers: int = 1, image_probe: ImageProbe | None = None) -> float:
    """`engines`: the run's EngineFleet. Returns the largest mean |engine - trainer| probe log-prob
    over the engines; raises
    WeightSyncMismatch above `tolerance` (None: `rounding_tolerance` for `num_layers` and the dtype
    the engines serve model.dtype `dtype` in: bf16 on GPUs, rlsys/system/backend.py engine_dtype).

    Both sides score the probes at the engine's score temperature (SCORE_TEMPERATURE: SGLang's
    prefill log-probs ignore the request's temperature), not at rollout.temperature. `image_probe`: a
    vision-language model's (`ImageProbe.of`), which checks the vision tower's weights too."""
    served = engine_dtype(engines.spec.has_gpu, dtype)
    versions = engines.weight_versions()
    stale = [i for i, version in enumerate(versions) if version != weight_version]
    if stale:
        raise WeightSyncMismatch(f"engine(s) {stale} report weight versions {versions}, expected {weight_version}")
    probes = probe_sequences(trainer.vocab_size(), seed,
                             excluded=image_probe.excluded if image_probe is not None else frozenset())
    expected = trainer.compute_log_probs([TrainSequence(p, prompt_len=1) for p in probes],
                                         temperature=SCORE_TEMPERATURE)
    worst = 0.0
    for index in range(len(engines.engines)):
        agreement = compare_logprobs(engines.score(probes, engine_index=index), expected)
        if image_probe is not None:  # the vision tower's weights too
            agreement = max(agreement, image_probe.agreement(trainer, engines, index, probes[0]),
                            key=lambda found: found.mean_abs_diff)
        bound = tolerance if tolerance is not None else rounding_tolerance(served, num_layers,
                                                                           agreement.mean_abs_logprob)
        logger.info("weight version %d, engine %d: mean |logprob diff| %.3g (max %.3g) over %d probe tokens, "
                    "bound %.3g", weight_version, index, agreement.mean_abs_diff, agreement.max_abs_diff,
                    agreement.tokens, bound)
        if agreement.mean_abs_diff > bound:
            raise WeightSyncMismatch(
                f"engine {index} ({engines.addresses[index].url}) disagrees with the trainer after syncing weight "
                f"version {weight_version}: mean |logprob diff| {agreement.mean_abs_diff:.3g} over {agreement.tokens} probe "
                f"tokens (max {agreement.max_abs_diff:.3g}) > {bound:.3g}, more than {served} rounding over "
                f"{num_layers} layers explains: a weight tensor is missing, stale, transposed or cast wrong on "
                "the engine (weight_sync.verify_tolerance sets the bound)"
            )
        worst = max(worst, agreement.mean_abs_diff)
    return worst

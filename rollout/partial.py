"""Partial rollouts: groups whose samples may stop part-way (an abort) and continue later.

A step of `rollout.mode: partial` stops generating once it has the groups it needs and aborts
the rest on the engines; each aborted sample keeps its tokens and log-probs, and the next round
continues it from prompt + tokens so far, with whatever weights the engines then hold. So one
response can hold tokens of several weight versions: `Generation.token_versions` says which
version sampled each token, and the engine log-probs stay per token (the behaviour policy of
each token, which TIS compares with the trainer's).
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, replace

from rlsys.records import EncodedPrompt, Generation, PromptRecord, SamplingParams


@dataclass
class GroupInFlight:
    """One prompt's group: for each sample, its generation so far (None: not started; aborted:
    to be continued)."""

    prompt: EncodedPrompt
    samples: list[Generation | None]

    @classmethod
    def new(cls, prompt: EncodedPrompt, size: int) -> GroupInFlight:
        return cls(prompt, [None] * size)

    @property
    def finished(self) -> bool:
        return all(sample is not None and not sample.aborted for sample in self.samples)

    def unfinished(self) -> list[int]:
        """Positions of the samples still to generate or continue."""
        return [i for i, sample in enumerate(self.samples) if sample is None or sample.aborted]

    def partial_samples(self) -> int:
        """Unfinished samples that hold tokens already."""
        return sum(1 for i in self.unfinished() if self.samples[i] is not None and self.samples[i].response_ids)

    def oldest_version(self) -> int | None:
        """The oldest weight version any token of the group came from (None: no token yet)."""
        versions = [min(_versions(s)) for s in self.samples if s is not None and s.response_ids]
        return min(versions, default=None)

    def restart_older_than(self, version: int) -> int:
        """Samples holding a token sampled before `version` start again from the prompt (finished
        ones too: no sample trained is older than the bound); the tokens thrown away."""
        discarded = 0
        for i, sample in enumerate(self.samples):
            if sample is not None and sample.response_ids and min(_versions(sample)) < version:
                discarded += len(sample.response_ids)
                self.samples[i] = None
        return discarded


def _versions(generation: Generation) -> list[int]:
    return generation.token_versions or [generation.weight_version] * len(generation.response_ids)


def continuation(prompt_ids: list[int], sample: Generation | None,
                 sampling: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The engine input that continues `sample` (prompt + its tokens so far) and its sampling
    parameters (max_new_tokens less the tokens already there). `sample` has tokens left to make
    (`settle` ended those that had none)."""
    if sample is None or not sample.response_ids:
        return list(prompt_ids), sampling
    left = sampling.max_new_tokens - len(sample.response_ids)
    assert left > 0, "a sample holding max_new_tokens tokens is settled, not continued"
    return list(prompt_ids) + list(sample.response_ids), replace(
        sampling, max_new_tokens=left, min_new_tokens=max(0, sampling.min_new_tokens - len(sample.response_ids)))


def stitch(prompt_ids: list[int], before: Generation | None, answer: Generation) -> Generation:
    """`before`'s tokens followed by the continuation `answer` (made from prompt + `before`): one
    response with each token's log-prob and weight version."""
    if before is None or not before.response_ids:
        return replace(answer, prompt_ids=list(prompt_ids),
                       token_versions=[answer.weight_version] * len(answer.response_ids))
    versions = _versions(before) + [answer.weight_version] * len(answer.response_ids)
    return replace(answer, prompt_ids=list(prompt_ids), response_ids=before.response_ids + answer.response_ids,
                   logprobs=before.logprobs + answer.logprobs, weight_version=min(versions), token_versions=versions,
                   routes=stitched_routes(before.routes, answer.routes))


def stitched_routes(before, answer):
    """Routing replay: the tokens `before` forwarded keep the experts they had when they were sampled;
    the continuation (which forwarded them again, with newer weights, as its prompt) gives the rest:
    `before`'s last token, which only the continuation forwarded, and its own."""
    if before is None or answer is None:
        return None
    import numpy as np

    return np.concatenate([before, answer[len(before):]])


def settle(sample: Generation, sampling: SamplingParams) -> Generation:
    """An aborted sample that had in fact ended, ended: an abort can land in the very step that
    samples a response's last token, and SGLang then answers "abort" (`Req.update_finish_state`
    takes a pending abort before its stop-token and length checks). Continuing such a sample
    would generate past its stop token. Its last token a stop token: "stop"; holding
    max_new_tokens tokens: "length". Any other sample is returned as it is. (Stop strings are
    not looked for: the engine matches those on text, which rlsys does not decode here.)"""
    if not sample.aborted or not sample.response_ids:
        return sample
    if not sampling.ignore_eos and sample.response_ids[-1] in sampling.stop_token_ids:
        return replace(sample, finish_reason="stop", stop_reason=None)
    if len(sample.response_ids) >= sampling.max_new_tokens:
        return replace(sample, finish_reason="length", stop_reason=None)
    return sample


# ---- checkpoint form (coordinator.json) ------------------------------------------------------

def group_to_json(group: GroupInFlight) -> dict:
    record = asdict(group.prompt.record)
    record["images"] = [base64.b64encode(image).decode() for image in record["images"]]  # bytes: not JSON
    return {"prompt": record, "token_ids": list(group.prompt.token_ids), "seed": group.prompt.seed,
            "samples": [None if s is None else _sample_to_json(s) for s in group.samples]}


def _sample_to_json(sample: Generation) -> dict:
    return {**asdict(sample), "routes": None if sample.routes is None else sample.routes.tolist()}


def group_from_json(data: dict) -> GroupInFlight:
    import numpy as np

    record = {**data["prompt"], "images": tuple(base64.b64decode(image) for image in data["prompt"].get("images", ())),
              "messages": tuple(data["prompt"].get("messages", ())), "tools": tuple(data["prompt"].get("tools", ()))}
    prompt = EncodedPrompt(PromptRecord(**record), list(data["token_ids"]), data.get("seed"))  # (older: no seed)
    samples = [None if s is None else Generation(**{**s, "routes": None if s.get("routes") is None else
                                                    np.asarray(s["routes"], dtype=np.int16)})
               for s in data["samples"]]
    return GroupInFlight(prompt, samples)

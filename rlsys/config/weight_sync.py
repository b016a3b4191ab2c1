"""weight_sync: moving the trainer's weights into the engines after each step."""

from __future__ import annotations

from pydantic import Field

from rlsys.section import Section


class WeightSyncConfig(Section):
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

"""Long-context benchmark (issue 48): per-rank memory and time of a train step on one long
sequence split over a context-parallel (CP) group of 1, 2 and 4 ranks. Prints one JSON object.

    .venv/bin/python bench/long_context.py [--out bench/results/long_context-DATE.json]   # ~10 min

The model: a tiny Qwen2 (MODEL: 4 layers, hidden 128, 8 query / 4 key-value heads) with a real
vocabulary's size (32,000: Llama 2's and Mistral 7B's), random fp32 weights written here, nothing
from a hub. (Qwen's 151,936 was tried first: the output layer's work, tokens x vocabulary, made a
CP 1 step on 1,024 tokens take 5-10 s here, and its per-rank transient, [512, 151,936] fp32
chunks, outweighed every activation a tractable length keeps.) The batch: one sequence of LENGTH
random ids, all but a PROMPT-token prompt in the loss (token-mean GRPO with its entropy, as
`TrainerWorker.train_step` runs it: one mini-batch, so no separate old-log-prob pass). Each CP size
is its own group of CP processes (torch.multiprocessing spawn, a gloo group, one data-parallel
group, `TrainerWorker` driven directly as bench/memory.py does): CP 1 (the plain one-rank path:
whole fp32 model, packed SDPA), ring at CP 2 and 4, Ulysses at CP 2; gradient checkpointing off
and on. The ratios and the search are on checkpointing off: there the activations a step keeps,
what CP divides, are largest; with it on a step keeps one hidden vector per token and layer, and
the per-rank terms that CP does not divide weigh more.

A rank's "activation part" (activation_peak_bytes): after a warm-up step (AdamW state allocated,
FSDP initialised), the rise of the process's peak resident memory during one `train_step` over
its resident memory right before it (VmHWM, reset just before the step through
/proc/self/clear_refs; freed heap handed back first with malloc_trim; glibc mmaps allocations
over MMAP_THRESHOLD, so a freed tensor leaves the resident set at once). It counts everything the
step allocates and frees again: activations kept for backward, attention and log-prob-head
transients, gradients (set to None after every step: the whole model's at CP 1, a shard plus a
layer's unsharded gradient under FSDP), FSDP's gathered parameters (CP > 1: the root's
embeddings and output layer stay gathered from forward to backward) and communication buffers.
Not counted: parameters, AdamW state, code and libraries, resident before the step. The largest
rank's figure over STEPS steps. Resident memory stands in for device memory: on this CPU machine
the host is the device.

Where the peak is (`phases`, `where_the_peak_is`): the ring and Ulysses attention's and the
chunked log-prob head's forward and backward are wrapped, each call reading the peak since the
last one: per function, the rise at its entry and its own transient above that entry; `peak_in`
names the function the step's peak fell in ("outside": none of them). `activation_part_vs_length`
fits each CP size's activation part to a line over every length it measured (MiB + KiB a token)
and solves where CP 2's and CP 4's would reach RATIO_LIMIT of CP 1's. `what_if` reruns CP 1 and 2
with a smaller `trainer.logprob_chunk_tokens`; the headline figures are of the code as it is.

`longest_sequence_under_budget`: with the budget B = CP 1's activation part at BUDGET_LENGTH, the
longest sequence whose activation part stays <= B on every rank of each CP group, by doubling
from BUDGET_LENGTH while it fits (bisecting below it when it does not) down to SEARCH_RESOLUTION
tokens: one measured step per probe, in the group's own processes.

Step time (step_s): the median over STEPS steps of the slowest rank's `train_step` seconds. CP 1
runs 2 threads on the machine's 2 cores, CP 2 one thread a rank; CP 4 puts 4 single-threaded
ranks on 2 cores, so its time is not what 4 devices would take. Other processes on the machine
stretch the times (not the memory): the output records the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))
MODEL = dict(vocab_size=32000, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=131072,
             tie_word_embeddings=False)
LENGTH = 8192  # the sequence of the ratios and step times
BUDGET_LENGTH = 4096  # the budget: CP 1's activation part at this length
PROMPT = 64  # tokens outside the loss
WARMUP_LENGTH = 512
STEPS = 2
SEARCH_RESOLUTION = 512
SEARCH_MAX = 32768
LOGPROB_CHUNK_TOKENS = 512  # trainer.logprob_chunk_tokens' default
RATIO_LIMIT = 0.6
# glibc serves allocations above this with mmap, so a freed tensor leaves the resident set at once.
# Its default climbs up to 32 MiB, and below it freed heap stays resident, fragmented: a threshold
# between a CP rank's per-layer tensors and CP 1's twice as large ones counts the first with their
# heap's slack and the second exactly (at 4 MiB, CP 2 held 86 MiB more at 8k tokens than at 256 KiB).
MMAP_THRESHOLD = 256 * 2**10
WHAT_IF_LOGPROB_CHUNK_TOKENS = 128

log = logging.getLogger("bench.long_context")


def build_model(directory: Path) -> Path:
    """MODEL's shapes, random fp32 weights (transformers' init, seed 0)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**MODEL, torch_dtype="float32")).save_pretrained(directory)
    return directory


# ---- inside a rank ------------------------------------------------------------------------
def _sequence(length: int):
    import random

    from rlsys.records import TrainSequence

    rng = random.Random(length)
    ids = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(length)]
    return TrainSequence(ids, prompt_len=PROMPT, advantage=1.0, loss_weight=1.0 / (length - PROMPT))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set


class PeakProbe:
    """A step's activation part, and which wrapped function its peak fell in. Every wrapped call
    folds the peak since the previous reading into the step's and resets it, so the step's peak
    is the same as one reading at its end."""

    def __init__(self):
        self.before = self.peak = 0
        self.peak_in = "outside"
        self.phases: dict[str, dict] = {}

    def start(self) -> None:
        import gc

        from rlsys.actors.trainer import _resident_bytes

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: before = live data
        self.before = self.peak = _resident_bytes()
        self.peak_in, self.phases = "outside", {}
        _reset_peak()

    def _fold(self, where: str) -> int:
        from rlsys.actors.trainer import peak_resident_bytes

        high = peak_resident_bytes()
        if high > self.peak:
            self.peak, self.peak_in = high, where
        _reset_peak()
        return high

    def finish(self) -> int:
        self._fold("outside")
        return self.peak - self.before

    def wrap(self, name: str, function):
        from rlsys.actors.trainer import _resident_bytes

        def probed(*args, **kwargs):
            self._fold("outside")
            entry = _resident_bytes()
            result = function(*args, **kwargs)
            high = self._fold(name)
            phase = self.phases.setdefault(name, {"calls": 0, "top_rise_bytes": 0})
            phase["calls"] += 1
            if high - self.before > phase["top_rise_bytes"]:
                phase.update(top_rise_bytes=high - self.before, entry_rise_bytes=entry - self.before,
                             own_transient_bytes=high - entry)
            return result

        return probed

    def install(self) -> None:
        """Wrap the attention's and the log-prob head's forward and backward (autograd Functions
        look their staticmethods up at call time)."""
        from rlsys.actors import chunked_logprobs, ring_attention

        for name, cls in (("ring_attention", ring_attention.RingAttention),
                          ("ulysses_attention", ring_attention.BlockAttention),
                          ("logprob_head", chunked_logprobs._ChunkedTargetLogProbs)):
            for method in ("forward", "backward"):
                setattr(cls, method, staticmethod(self.wrap(f"{name}.{method}", getattr(cls, method))))


def _measured_step(worker, probe: PeakProbe, length: int) -> dict:
    import torch.distributed as dist

    sequence = _sequence(length)
    dist.barrier()
    probe.start()
    started = time.perf_counter()
    worker.train_step([[sequence]])
    seconds = time.perf_counter() - started
    rise = probe.finish()
    return {"rise_bytes": rise, "seconds": seconds, "peak_in": probe.peak_in, "phases": probe.phases}


def _group_max(*values: float) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _longest_under(worker, probe: PeakProbe, budget: int, start: int, cp: int, start_fits: bool) -> dict:
    """The longest length (a multiple of SEARCH_RESOLUTION, at most SEARCH_MAX) whose activation
    part stays <= `budget` on every rank of the group: doubling from `start` while it fits, then
    bisection (`start_fits`: known, not probed). Collective: every rank takes the same decisions
    from the group's maxima."""
    probes = []

    def fits(length: int) -> bool:
        if start_fits and length == start:
            return True
        measured = _measured_step(worker, probe, length)
        rise, seconds = _group_max(measured["rise_bytes"], measured["seconds"])
        probes.append({"length": length, "rise_bytes": int(rise), "step_s": round(seconds, 2)})
        log.info("CP %d probe %d tokens: %.0f MiB (budget %.0f MiB), %.1f s", cp, length, rise / 2**20,
                 budget / 2**20, seconds)
        return rise <= budget

    good, bad, length = 0, None, start
    while length <= SEARCH_MAX:
        if not fits(length):
            bad = length
            break
        good, length = length, 2 * length
    if bad is None:
        return {"length": good, "capped_at": SEARCH_MAX, "probes": probes}
    while bad - good > SEARCH_RESOLUTION:
        middle = (good + bad) // 2 // SEARCH_RESOLUTION * SEARCH_RESOLUTION
        if middle <= good:
            break
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return {"length": good, "shortest_over": bad, "probes": probes}


def _rank(rank: int, job: dict, meeting, results: str) -> None:
    """One rank of a CP group: a warm-up step, STEPS measured steps at `job["length"]`, then the
    search when the job has a budget."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s   rank {rank}: %(message)s", stream=sys.stderr)
    from rlsys.actors.trainer import TrainerSpec, TrainerWorker
    from rlsys.config import ModelConfig, TrainerConfig

    cp = job["cp"]
    spec = TrainerSpec(ModelConfig(path=job["model_dir"]), TrainerConfig(
        num_ranks=cp, context_parallel_size=cp, context_parallel_style=job["style"], lr=1e-5, packing=True,
        max_tokens_per_microbatch=SEARCH_MAX, logprob_chunk_tokens=job["logprob_chunk_tokens"],
        gradient_checkpointing=job["checkpointing"], threads_per_rank=max(1, CORES // cp)))
    worker = TrainerWorker(spec, rank=rank, world_size=cp)
    if rank == 0:  # rank 0 holds the group's port until its store serves it (rlsys/system/rendezvous.py)
        address = worker.rendezvous_address()
        for _ in range(cp - 1):
            meeting.put(address)
    worker.setup(*(address if rank == 0 else meeting.get()))
    worker.train_step([[_sequence(WARMUP_LENGTH)]])
    probe = PeakProbe()
    probe.install()
    steps = [_measured_step(worker, probe, job["length"]) for _ in range(STEPS)]
    record = {"steps": steps}
    if job.get("budget") == "own":  # CP 1: the budget is its own activation part at BUDGET_LENGTH
        record["budget_step"] = _measured_step(worker, probe, BUDGET_LENGTH)
        budget = _group_max(record["budget_step"]["rise_bytes"])[0]
        record["search"] = _longest_under(worker, probe, int(budget), BUDGET_LENGTH, cp, start_fits=True)
    elif job.get("budget"):
        record["search"] = _longest_under(worker, probe, job["budget"], BUDGET_LENGTH, cp, start_fits=False)
    Path(results, f"rank{rank}.json").write_text(json.dumps(record))
    import torch.distributed as dist

    dist.barrier()  # the group's ranks tear down together
    worker.shutdown()


# ---- the driver ---------------------------------------------------------------------------
def run_group(model_dir: Path, cp: int, style: str, checkpointing: bool, length: int,
              budget: int | str | None = None, logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> dict:
    """One CP group in its own processes: the largest rank's activation part (and where its peak
    fell), the slowest rank's seconds."""
    import torch.multiprocessing as mp

    job = dict(model_dir=str(model_dir), cp=cp, style=style, checkpointing=checkpointing, length=length,
               budget=budget, logprob_chunk_tokens=logprob_chunk_tokens)
    log.info("CP %d %s, gradient checkpointing %s, %d tokens%s%s", cp, style, "on" if checkpointing else "off",
             length, "; then the longest under " + (f"{budget / 2**20:.0f} MiB" if budget != "own" else "its own peak")
             if budget else "",
             f"; logprob_chunk_tokens {logprob_chunk_tokens}" if logprob_chunk_tokens != LOGPROB_CHUNK_TOKENS else "")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as results:
        try:
            meeting = mp.get_context("spawn").SimpleQueue()  # where rank 0 tells the others its port
            mp.start_processes(_rank, args=(job, meeting, results), nprocs=cp, start_method="spawn")
        except mp.ProcessExitedException as error:
            # Seen once in gloo's teardown ("terminate called without an active exception"), after
            # every rank had written its figures: those stand; a rank that died earlier has none.
            if not all(Path(results, f"rank{r}.json").exists() for r in range(cp)):
                raise
            log.warning("  a rank died after writing its figures (%s); keeping them", error)
        ranks = [json.loads(Path(results, f"rank{r}.json").read_text()) for r in range(cp)]
    rises = [max(step["rise_bytes"] for step in r["steps"]) for r in ranks]
    top = max(range(cp), key=lambda r: rises[r])
    top_step = max(ranks[top]["steps"], key=lambda step: step["rise_bytes"])
    seconds = [max(r["steps"][i]["seconds"] for r in ranks) for i in range(STEPS)]
    result = {"cp": cp, "style": style if cp > 1 else None, "gradient_checkpointing": checkpointing, "length": length,
              "activation_peak_bytes": max(rises), "activation_peak_bytes_per_rank": rises,
              "peak_in": top_step["peak_in"], "phases": top_step["phases"],
              "step_s": round(statistics.median(seconds), 2), "step_s_each": [round(s, 2) for s in seconds],
              "group_wall_s": round(time.perf_counter() - started, 1)}
    if cp > 1:
        from rlsys.actors.cp_layout import padded_length

        result["tokens_per_rank"] = padded_length(length, cp) // cp
    if logprob_chunk_tokens != LOGPROB_CHUNK_TOKENS:
        result["logprob_chunk_tokens"] = logprob_chunk_tokens
    if budget:
        result["search"] = ranks[0]["search"]
        result["budget_bytes"] = ranks[0]["budget_step"]["rise_bytes"] if budget == "own" else budget
    log.info("  activation part %.0f MiB (peak in %s), step %.2f s; %.0f s in all", max(rises) / 2**20,
             result["peak_in"], result["step_s"], result["group_wall_s"])
    return result


def _mib(value: float) -> float:
    return round(value / 2**20, 1)


def _where(run: dict) -> dict:
    """The peak's phase of a run: its rise at the phase's entry and the phase's own transient."""
    phase = run["phases"].get(run["peak_in"], {})
    return {"peak_in": run["peak_in"], "activation_peak_mib": _mib(run["activation_peak_bytes"]),
            "entry_rise_mib": _mib(phase["entry_rise_bytes"]) if phase else None,
            "own_transient_mib": _mib(phase["own_transient_bytes"]) if phase else None}


def linear_fit(run: dict) -> dict:
    """Least squares of the group's activation part against the sequence length over every step it
    measured (the steps at LENGTH and the search's probes): MiB + KiB a token."""
    points = [(run["length"], run["activation_peak_bytes"])]
    points += [(probe["length"], probe["rise_bytes"]) for probe in run.get("search", {}).get("probes", [])]
    if "budget_bytes" in run and run["cp"] == 1:
        points.append((BUDGET_LENGTH, run["budget_bytes"]))
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return {"mib_at_zero": _mib(intercept), "kib_per_token": round(slope / 1024, 2), "points": len(points)}


def crossing(one: dict, other: dict, ratio: float) -> int | None:
    """The length at which the fits give other / one = `ratio` (None if they never do)."""
    a1, b1 = one["mib_at_zero"], one["kib_per_token"] / 1024
    a2, b2 = other["mib_at_zero"], other["kib_per_token"] / 1024
    if ratio * b1 <= b2:
        return None
    return max(0, round((a2 - ratio * a1) / (ratio * b1 - b2)))


def summary(ring: dict, checkpointed: dict, ulysses: dict, small_chunks: dict) -> dict:
    peak = {cp: run["activation_peak_bytes"] for cp, run in ring.items()}
    ratio = {cp: round(peak[cp] / peak[1], 3) for cp in (2, 4)}
    longest = {str(cp): run["search"]["length"] for cp, run in ring.items()}
    ckpt = {cp: run["activation_peak_bytes"] for cp, run in checkpointed.items()}
    fits = {cp: linear_fit(run) for cp, run in ring.items()}
    return {
        "activation_peak_ratio_cp2": ratio[2],
        "activation_peak_ratio_cp4": ratio[4],
        "ratio_cp2_at_most_0_6": ratio[2] <= RATIO_LIMIT,
        "longest_sequence_under_budget": longest,
        "longest_grows_with_cp": int(longest["1"]) < int(longest["2"]) < int(longest["4"]),
        "budget_mib": _mib(ring[1]["budget_bytes"]),
        "activation_peak_mib": {str(cp): _mib(p) for cp, p in peak.items()},
        "step_s": {str(cp): run["step_s"] for cp, run in ring.items()},
        "where_the_peak_is": {str(cp): _where(run) for cp, run in ring.items()},
        "activation_part_vs_length": {
            **{str(cp): fit for cp, fit in fits.items()},
            "ratio_cp2_reaches_0_6_at_tokens": crossing(fits[1], fits[2], RATIO_LIMIT),
            "ratio_cp4_reaches_0_6_at_tokens": crossing(fits[1], fits[4], RATIO_LIMIT)},
        "gradient_checkpointing_on": {
            "activation_peak_mib": {str(cp): _mib(p) for cp, p in ckpt.items()},
            "activation_peak_ratio_cp2": round(ckpt[2] / ckpt[1], 3),
            "activation_peak_ratio_cp4": round(ckpt[4] / ckpt[1], 3),
            "step_s": {str(cp): run["step_s"] for cp, run in checkpointed.items()},
            "where_the_peak_is": {str(cp): _where(run) for cp, run in checkpointed.items()}},
        "ulysses_cp2": {"activation_peak_ratio": round(ulysses["activation_peak_bytes"] / peak[1], 3),
                        "step_s": ulysses["step_s"], **_where(ulysses)},
        "what_if": {f"logprob_chunk_tokens_{WHAT_IF_LOGPROB_CHUNK_TOKENS}": {
            "activation_peak_ratio_cp2": round(small_chunks[2]["activation_peak_bytes"]
                                               / small_chunks[1]["activation_peak_bytes"], 3),
            "activation_peak_mib": {str(cp): _mib(run["activation_peak_bytes"]) for cp, run in small_chunks.items()},
            "where_the_peak_is": {str(cp): _where(run) for cp, run in small_chunks.items()}}},
    }


def _code_state() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_in_actors": git("status", "--porcelain", "--", "actors").splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--length", type=int, default=LENGTH, help="tokens of the sequence of the ratios")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the spawned ranks' glibc reads it at start
    started, load_before, code_before = time.perf_counter(), os.getloadavg(), _code_state()
    length = args.length
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        one = run_group(model_dir, 1, "ring", False, length, budget="own")
        budget = one["budget_bytes"]
        ring = {1: one, **{cp: run_group(model_dir, cp, "ring", False, length, budget) for cp in (2, 4)}}
        checkpointed = {cp: run_group(model_dir, cp, "ring", True, length) for cp in (1, 2, 4)}
        ulysses = run_group(model_dir, 2, "ulysses", False, length)
        # A what-if (the figures above are the result): the log-prob head's chunk, which CP does not divide.
        small_chunks = {cp: run_group(model_dir, cp, "ring", False, length,
                                      logprob_chunk_tokens=WHAT_IF_LOGPROB_CHUNK_TOKENS) for cp in (1, 2)}
    result = summary(ring, checkpointed, ulysses, small_chunks)
    result["settings"] = {
        "model": MODEL, "length": length, "prompt_tokens": PROMPT, "dtype": "float32",
        "logprob_chunk_tokens": LOGPROB_CHUNK_TOKENS, "ratios_on": "ring attention, gradient checkpointing off",
        "budget": f"CP 1's activation part at {BUDGET_LENGTH} tokens", "measured_steps": STEPS,
        "warmup_length": WARMUP_LENGTH, "search_resolution": SEARCH_RESOLUTION, "search_max": SEARCH_MAX,
        "malloc_mmap_threshold": MMAP_THRESHOLD,
        "cores": CORES, "threads_per_rank": {str(cp): max(1, CORES // cp) for cp in (1, 2, 4)},
        # Other processes on the machine stretch the step times, not the memory figures.
        "load_average_1_5_15_min": {"start": load_before, "end": os.getloadavg()}, **code_before,
        "code_changed_during_run": _code_state() != code_before}
    result["notes"] = [
        f"CP 4 runs 4 single-threaded ranks on {CORES} cores: its memory per rank is what 4 devices would hold, "
        "its step time is not what they would take (nor is CP 2's: one thread a rank)",
        "activation part: a rank's peak resident memory during a train step over its resident memory right before "
        "(parameters, AdamW state and libraries excluded; gradients, FSDP's gathered parameters, activations and "
        "every transient included); the largest rank's, the worst of the measured steps",
        "what_if rows change a constant or a setting inside the bench's own processes; the ratios above are of the "
        "code as it is"]
    result["runs"] = [*ring.values(), *checkpointed.values(), ulysses, *small_chunks.values()]
    result["bench_wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

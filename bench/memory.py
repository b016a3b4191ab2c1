"""Memory benchmark: a trainer rank's peak while loading, and a train step's peak with chunked
log-probs against the unchunked full-vocabulary path. Prints one JSON object.

    .venv/bin/python bench/memory.py [--out bench/results/memory-DATE.json]

- `load_peak_over_model_bytes`: 2 trainer ranks (Ray actors, gloo) load Qwen2.5-0.5B's shapes
  (494 M params, random bf16 weights written here); the largest rise of a rank's resident memory
  during the load over the model's fp32 bytes. `load_peak_over_model_bytes_whole_model` is the
  same measurement for the path used before (every rank: `from_pretrained` of the whole fp32
  model), in a fresh process.
- `train_step_peak_over_unchunked`: one rank, a tiny Qwen2 with Qwen's 151,936-token vocabulary,
  one train step on 2,048 tokens in one micro-batch; the rise of peak resident memory with
  `trainer.logprob_chunk_tokens=512` (the default) over the rise with 0 (full-vocabulary logits kept for
  backward, as plain autograd does), each in a fresh process.
Resident memory stands in for device memory here: on this CPU machine the host is the device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHUNK = 512  # trainer.logprob_chunk_tokens' default

_WHOLE_MODEL_LOAD = """
import sys, psutil, torch
from transformers import AutoModelForCausalLM
from rlsys.actors.trainer import peak_resident_bytes
before = psutil.Process().memory_info().rss
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
print(peak_resident_bytes() - before)
"""

_TRAIN_STEP = """
import json, random, sys, psutil, torch, os
os.environ.update(MASTER_ADDR="127.0.0.1")
from rlsys.records import TrainSequence
from rlsys.actors.trainer import TrainerSpec, TrainerWorker, peak_resident_bytes
from rlsys.config import ModelConfig, TrainerConfig
model_dir, chunk = sys.argv[1], int(sys.argv[2])
spec = TrainerSpec(ModelConfig(path=model_dir), TrainerConfig(
    num_ranks=1, lr=1e-4, packing=True, max_tokens_per_microbatch=4096, logprob_chunk_tokens=chunk))
worker = TrainerWorker(spec, rank=0, world_size=1)
worker.setup(*worker.rendezvous_address())
rng = random.Random(0)
batch = [TrainSequence([rng.randrange(3, 150000) for _ in range(256)], prompt_len=32,
                       advantage=rng.uniform(-1, 1)) for _ in range(8)]
before = psutil.Process().memory_info().rss
worker.train_step([batch])
print(json.dumps({"rise_bytes": peak_resident_bytes() - before}))
"""


def load_peaks(model_dir: Path) -> dict:
    import ray

    from rlsys.actors.inspectable_group import InspectableTrainerGroup
    from rlsys.actors.trainer import TrainerSpec
    from rlsys.config import ModelConfig, TrainerConfig
    from rlsys.system.cluster import ACTOR_ENV

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ACTOR_ENV})
    try:
        group = InspectableTrainerGroup(TrainerSpec(ModelConfig(path=str(model_dir)), TrainerConfig(num_ranks=2)), 2)
        reports = group.load_memory_reports()
        group.shutdown()
    finally:
        ray.shutdown()
    model_bytes = reports[0]["model_bytes"]
    rises = [r["peak_rss_bytes"] - r["rss_before_bytes"] for r in reports]
    whole = int(subprocess.run([sys.executable, "-c", _WHOLE_MODEL_LOAD, str(model_dir)], check=True,
                               capture_output=True, text=True, cwd=REPO).stdout.split()[-1])
    return {"model_bytes": model_bytes, "load_peak_rise_bytes_per_rank": rises,
            "load_peak_over_model_bytes": round(max(rises) / model_bytes, 3),
            "load_peak_over_model_bytes_whole_model": round(whole / model_bytes, 3)}


def train_step_peaks(work: Path) -> dict:
    model_dir = work / "vocab152k"
    _make_large_vocab_model(model_dir)
    # Both variants at once, each in its own process: a peak is the process's own (ru_maxrss of its
    # address space), and most of each run is a single-threaded start-up (imports).
    variants = {chunk: subprocess.Popen([sys.executable, "-c", _TRAIN_STEP, str(model_dir), str(chunk)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                        env={**os.environ, "OMP_NUM_THREADS": "2"})
                for chunk in (CHUNK, 0)}
    rises = {}
    for chunk, process in variants.items():
        out, err = process.communicate()
        if process.returncode != 0:
            raise subprocess.CalledProcessError(process.returncode, process.args, out, err)
        rises[chunk] = json.loads(out.strip().splitlines()[-1])["rise_bytes"]
    return {"train_step_peak_rise_bytes_chunked": rises[CHUNK], "train_step_peak_rise_bytes_unchunked": rises[0],
            "train_step_peak_over_unchunked": round(rises[CHUNK] / rises[0], 3)}


def _make_large_vocab_model(out_dir: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = parser.parse_args()
    from rlsys.tools.tiny_model import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_random_checkpoint(work / "qwen2.5-0.5b", "qwen2.5-0.5b")
        result = {"load_model": "Qwen2.5-0.5B shapes, 2 ranks", **load_peaks(work / "qwen2.5-0.5b"),
                  **train_step_peaks(work)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

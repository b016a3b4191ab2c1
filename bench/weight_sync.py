"""Weight-sync benchmark: both transports end to end into a real SGLang engine, against a naive
baseline and against this machine's own memcpy and all-gather bandwidth, measured in one run.
Prints one JSON object.

    .venv/bin/python bench/weight_sync.py [--hidden-size 1024 --layers 32 --bucket-mb 64 512 1024]

The synthetic model is a Qwen2 of ~0.5 B parameters (fp32, ~2 GB) built locally; 2 FSDP2 ranks
hold it sharded; one SGLang engine (CPU) serves it. Stages, for one sync, timed on trainer rank 0:
- gather_s: gathering each bucket's shards straight into rank 0's reusable staging buffer, which
  then is the bucket (one engine: only rank 0 needs the full tensors, so the other ranks send
  their shards point-to-point instead of all-gathering; no separate flattening copy);
- handover_s: per-bucket fixed cost of the hand-over (colocated: pickling the IPC handle + the
  HTTP round trip; broadcast: HTTP request + group round trip), measured with a one-tensor bucket;
- load_s: the rest of the per-bucket call: the engine maps (colocated) or receives (broadcast)
  the bucket and copies it into its parameters (colocated: `weight_sync.engine_loader`, with
  `engine_weight_load_threads` threads, the machine's cores: the trainer ranks wait meanwhile);
- after_gather_s = handover_s + load_s; total_s = the whole sync, gather included.
The naive baseline gathers the full state dict on rank 0, torch.save()s it to bytes, writes them
to a file the engine reads and has the engine load them (/update_weights_from_disk).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
import torch

from rlsys.actors.group import TrainerGroup
from rlsys.actors.trainer import TrainerSpec, TrainerWorker
from rlsys.config import EngineConfig, ModelConfig, TrainerConfig
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.sglang.client import EngineAddress
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.system.topology import Topology
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model


class PeakRSS:
    """Samples this process's RSS every 2 ms; `peak - start` is the extra memory of the block."""

    def __enter__(self):
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.extra = self.peak - self.start


class BenchTrainerWorker(TrainerWorker):
    """A trainer rank with measuring wrappers around the library's own sync paths."""

    def measured_sync(self, bucket_bytes: int, version: int) -> dict:
        with PeakRSS() as memory:
            stats = self.sync_weights(bucket_bytes, version)
        return {**stats, "extra_peak_rss_bytes": memory.extra}

    def handover_overhead(self, repeats: int = 5) -> float:
        """Seconds of one bucket's hand-over with almost nothing in it: the smallest parameter (a
        norm weight, a few KB), so the time is the fixed cost of a bucket, not its bytes."""
        from rlsys.weight_sync.buckets import gather_bucket, gather_full_tensor

        name, param = min(self.model.named_parameters(), key=lambda item: item[1].numel())
        tiny = [(name, gather_full_tensor(param))]  # collective: every rank takes part
        if self.rank != 0:
            return 0.0
        transport = self.transport
        times = []
        transport.begin()
        for _ in range(repeats):
            buffer = transport.staging_buffer(1 << 20, tiny[0][1].device)
            bucket = gather_bucket(tiny, buffer, transport.alignment)  # a plain tensor: copied in
            start = time.perf_counter()
            transport.send_bucket(bucket, flush_cache=False, weight_version=None)
            times.append(time.perf_counter() - start)
        transport.end()
        return statistics.median(times)

    def naive_sync(self, engine: EngineAddress, model_dir: str, stage_dir: str) -> dict:
        """Full state dict on rank 0 -> torch.save bytes -> written -> engine loads from disk."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        timings = {}
        with PeakRSS() as memory:
            start = time.perf_counter()
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            timings["gather_s"] = time.perf_counter() - start
            if self.rank == 0:
                tick = time.perf_counter()
                buffer = io.BytesIO()
                torch.save(state, buffer)
                timings["serialize_s"] = time.perf_counter() - tick
                tick = time.perf_counter()
                Path(stage_dir).mkdir(parents=True, exist_ok=True)
                (Path(stage_dir) / "model.pt").write_bytes(buffer.getbuffer())
                for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
                    if (Path(model_dir) / name).exists():
                        shutil.copy2(Path(model_dir) / name, Path(stage_dir) / name)
                timings["send_s"] = time.perf_counter() - tick
                tick = time.perf_counter()
                _post(engine, "/update_weights_from_disk", {"model_path": stage_dir, "load_format": "pt"})
                timings["load_s"] = time.perf_counter() - tick
                timings["bytes"] = buffer.getbuffer().nbytes
            timings["total_s"] = time.perf_counter() - start
        timings["extra_peak_rss_bytes"] = memory.extra
        return timings

    def raw_gather_bandwidth(self, nbytes: int, repeats: int = 3) -> dict:
        """GB/s (full-tensor bytes / seconds) of the backend's raw collectives on plain tensors:
        all_gather_into_tensor, and shards sent point-to-point to rank 0 (what a sync to a single
        engine does, `weight_sync.buckets.gather_shards_to`)."""
        import torch.distributed as dist

        from rlsys.weight_sync.buckets import gather_shards_to

        shard = torch.ones(nbytes // self.world_size // 4, dtype=torch.float32)
        out = torch.empty(shard.numel() * self.world_size, dtype=torch.float32)
        primitives = {
            "all_gather": lambda: dist.all_gather_into_tensor(out, shard),
            "gather_to_rank0": lambda: gather_shards_to(shard, out if self.rank == 0 else None, 0, dist.group.WORLD),
        }
        result = {}
        for name, run in primitives.items():
            run()  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            result[name] = out.numel() * 4 / statistics.median(times) / 1e9
        return result


def _post(engine: EngineAddress, endpoint: str, payload: dict) -> None:
    """The baseline's one call, outside the library's client (which has no disk-loading method)."""
    import urllib.request

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {engine.api_key}"}
    request = urllib.request.Request(f"{engine.url}{endpoint}", data=json.dumps(payload).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=900) as response:
        response.read()


def memcpy_gbps(nbytes: int = 1 << 30, repeats: int = 5, threads: int | None = None) -> float:
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _memcpy_gbps(nbytes, repeats)
    finally:
        torch.set_num_threads(previous)


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def summarize(stats: list[dict], handover_per_bucket: float) -> dict:
    rank0 = stats[0]
    handover = handover_per_bucket * rank0["buckets"]
    load = max(rank0["handover_and_load_s"] - handover, 0.0)
    after_gather = rank0["handover_and_load_s"]
    gb = rank0["bytes"] / 1e9
    return {
        "buckets": rank0["buckets"], "bytes": rank0["bytes"],
        "gather_s": rank0["gather_s"], "handover_s": handover, "load_s": load,
        "after_gather_s": after_gather, "total_s": rank0["total_s"],
        "gather_gbps": gb / rank0["gather_s"], "after_gather_gbps": gb / after_gather, "total_gbps": gb / rank0["total_s"],
        "extra_peak_rss_bytes_rank0": rank0["extra_peak_rss_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlsys-bench-ws-"))
    model_dir = work / "model"
    make_tiny_model(model_dir, TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=16,
                                             num_kv_heads=4, intermediate_size=args.hidden_size * 4))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    num_params = sum(p.numel() for p in skeleton.parameters())
    result = {"model_parameters": num_params, "model_bytes": num_params * 4,
              "memcpy_gbps": memcpy_gbps(), "memcpy_gbps_1_thread": memcpy_gbps(threads=1),
              "torch_threads": torch.get_num_threads(),
              "engine_weight_load_threads": len(os.sched_getaffinity(0))}  # ServerSpec's default

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)  # trainer ranks set 1 thread themselves
    engine_config = EngineConfig(skip_tokenizer_init=True, context_length=128, max_total_tokens=2048,
                                 mem_fraction_static=0.2, startup_timeout_s=900, request_timeout_s=900)
    rollout = RolloutManager(ServerSpec(ModelConfig(path=str(model_dir)), engine_config),
                             1, str(work / "logs"), [{"num_cpus": 1}])
    group = None
    try:
        group = TrainerGroup(TrainerSpec(ModelConfig(path=str(model_dir)), TrainerConfig(lr=1e-5)), 2,
                             worker_cls=BenchTrainerWorker)
        engine = rollout.wait_ready()[0]
        raw = ray.get([w.raw_gather_bandwidth.remote(256 << 20) for w in group.workers])[0]
        result["allgather_gbps_gloo_2_ranks"] = raw["all_gather"]
        result["gather_to_rank0_gbps_gloo_2_ranks"] = raw["gather_to_rank0"]

        version = 0
        result["colocated"], result["broadcast"] = {}, {}
        for transport in ("colocated", "broadcast"):
            mode = "colocated" if transport == "colocated" else "disaggregated"
            topology = Topology(mode, 2, 1, 1, has_gpu=False, trainers_sleep=False).with_engines([engine])
            group.connect_engines(topology, timeout_s=600)
            for bucket_mb in args.bucket_mb:
                runs = []
                for _ in range(args.repeats):
                    version += 1
                    runs.append(ray.get([w.measured_sync.remote(bucket_mb << 20, version) for w in group.workers]))
                overhead = ray.get([w.handover_overhead.remote() for w in group.workers])[0]
                best = min(runs, key=lambda stats: stats[0]["total_s"])  # warm run: buffers reused
                result[transport][f"{bucket_mb}MB"] = summarize(best, overhead)
                assert rollout.weight_versions() == [version]

        naive = ray.get([w.naive_sync.remote(engine, str(model_dir), str(work / "naive")) for w in group.workers])[0]
        naive["gbps"] = naive["bytes"] / 1e9 / naive["total_s"]
        result["naive"] = naive
    finally:
        if group is not None:
            group.shutdown()
        rollout.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    colocated_best = min(result["colocated"].values(), key=lambda r: r["total_s"])
    result["checks"] = {
        "colocated_after_gather_over_memcpy": colocated_best["after_gather_gbps"] / result["memcpy_gbps"],
        # for comparison only: the engine's load uses every core, as memcpy_gbps does
        "colocated_after_gather_over_memcpy_1_thread": colocated_best["after_gather_gbps"] / result["memcpy_gbps_1_thread"],
        "colocated_total_speedup_over_naive": result["naive"]["total_s"] / colocated_best["total_s"],
        "broadcast_total_speedup_over_naive": result["naive"]["total_s"] / min(
            r["total_s"] for r in result["broadcast"].values()),
        "gather_over_raw_allgather": colocated_best["gather_gbps"] / result["allgather_gbps_gloo_2_ranks"],
        "gather_over_raw_gather_to_rank0": colocated_best["gather_gbps"] / result["gather_to_rank0_gbps_gloo_2_ranks"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Weight-sync benchmark: both transports end to end into a real SGLang engine, pipelined and
serial side by side, against a naive baseline and against this machine's own memcpy and gather
bandwidth, measured in one run. Prints one JSON object.

    .venv/bin/python bench/weight_sync.py [--hidden-size 1024 --layers 32 --bucket-mb 64 512 1024]

The synthetic model is a Qwen2 of ~0.5 B parameters (fp32, ~2 GB) built locally; 2 FSDP2 ranks
hold it sharded; one SGLang engine (CPU) serves it. For one sync, timed on trainer rank 0:
- gather_s: gathering each bucket's shards straight into one of rank 0's reusable staging
  buffers, which then is the bucket (one engine: only rank 0 needs the full tensors, so the other
  ranks send their shards point-to-point instead of all-gathering; no separate flattening copy);
- engine_wait_s: rank 0 waiting on the engine: begin, each bucket's hand-over and load (colocated:
  pickling the IPC handle + the HTTP round trip, then `weight_sync.engine_loader` copying with
  `engine_weight_load_threads` threads (each mode against an engine launched as `rlsys train`
  launches it for that mode: every core serial, half of them pipelined); broadcast: the request +
  the broadcast + SGLang's load), end. Serial, all of it; pipelined, only what the next bucket's gather did not hide;
- serial only: handover_s, the per-bucket fixed cost (one-tensor buckets) times the buckets, and
  load_s, the rest of the wait;
- total_s: the whole sync; total_over_memcpy: its bytes/s over this machine's memcpy.
`fixed_cost_per_sync`: the median whole sync of the quickstart's 133,696-parameter model (one
bucket), serial and pipelined: what a sync costs beyond its bytes.
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

    def measured_sync(self, bucket_bytes: int, version: int, pipelined: bool) -> dict:
        with PeakRSS() as memory:
            stats = self.sync_weights(bucket_bytes, version, pipelined)
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
        self.backend.prepare_ipc()  # as sync_weights does: handles another process can open
        times = []
        transport.begin().result()
        for _ in range(repeats):
            buffer = transport.staging_buffer(0, 1 << 20, tiny[0][1].device)
            bucket = gather_bucket(tiny, buffer, transport.alignment)  # a plain tensor: copied in
            start = time.perf_counter()
            transport.send_bucket(bucket, flush_cache=False, weight_version=None).result()
            times.append(time.perf_counter() - start)
        transport.end().result()
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
            "gather_to_rank0": lambda: [work.wait() for work in gather_shards_to(
                shard, out if self.rank == 0 else None, 0, dist.group.WORLD)],
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


def summarize(stats: list[dict], handover_per_bucket: float, memcpy: float) -> dict:
    rank0 = stats[0]
    gb = rank0["bytes"] / 1e9
    summary = {
        "buckets": rank0["buckets"], "bytes": rank0["bytes"],
        "gather_s": rank0["gather_s"], "engine_wait_s": rank0["engine_wait_s"], "total_s": rank0["total_s"],
        "gather_gbps": gb / rank0["gather_s"], "total_gbps": gb / rank0["total_s"],
        "total_over_memcpy": gb / rank0["total_s"] / memcpy,
        "extra_peak_rss_bytes_rank0": rank0["extra_peak_rss_bytes"],
    }
    if not rank0["pipelined"]:  # serial: the wait is the hand-overs and the loads, one after another
        handover = handover_per_bucket * rank0["buckets"]
        summary.update(handover_s=handover, load_s=max(rank0["engine_wait_s"] - handover, 0.0))
    return summary


def tiny_model_fixed_cost(work: Path, syncs: int = 20) -> dict:
    """Median seconds of a whole sync of the quickstart's tiny model (133,696 parameters, one
    bucket): what a sync costs whatever its bytes (requests, queues, barriers), per transport,
    serial and pipelined."""
    model_dir = make_tiny_model(work / "tiny-model", TinyModelSpec())
    engine_config = EngineConfig(skip_tokenizer_init=True, context_length=64, max_total_tokens=2048)
    rollout = RolloutManager.start(ServerSpec(ModelConfig(path=str(model_dir)), engine_config), 1,
                             str(work / "tiny-logs"), [{"num_cpus": 1}])  # one bucket: no load to overlap
    group, result, version = None, {}, 0
    try:
        group = TrainerGroup(TrainerSpec(ModelConfig(path=str(model_dir)), TrainerConfig(lr=1e-5)), 2,
                             worker_cls=BenchTrainerWorker)
        engine = rollout.fleet.wait_ready()[0]
        for transport in ("colocated", "broadcast"):
            mode = "colocated" if transport == "colocated" else "disaggregated"
            topology = Topology(mode, 2, 1, 1, has_gpu=False, trainers_sleep=False).with_engines([engine])
            group.connect_engines(topology, timeout_s=600)
            for pipelined in (False, True):
                seconds = []
                for _ in range(syncs):
                    version += 1
                    stats = group.sync_weights(16 << 20, version, pipelined)
                    seconds.append(max(rank["total_s"] for rank in stats))
                result[f"{transport}_{'pipelined' if pipelined else 'serial'}_s"] = statistics.median(seconds)
            assert rollout.fleet.weight_versions() == [version]
    finally:
        if group is not None:
            group.shutdown()
        rollout.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-load-threads", type=int, default=None,
                        help="rollout.engine.weight_load_threads (default: the machine's cores)")
    parser.add_argument("--skip-fixed-cost", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlsys-bench-ws-"))
    model_dir = work / "model"
    make_tiny_model(model_dir, TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=16,
                                             num_kv_heads=4, intermediate_size=args.hidden_size * 4))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    num_params = sum(p.numel() for p in skeleton.parameters())
    cores = len(os.sched_getaffinity(0))
    result = {"model_parameters": num_params, "model_bytes": num_params * 4,
              "memcpy_gbps": memcpy_gbps(), "memcpy_gbps_1_thread": memcpy_gbps(threads=1),
              "torch_threads": torch.get_num_threads(),
              "engine_weight_load_threads": args.engine_load_threads or {
                  "serial": ServerSpec(ModelConfig(path=str(model_dir)), pipelined_sync=False).load_threads(cores),
                  "pipelined": ServerSpec(ModelConfig(path=str(model_dir))).load_threads(cores)}}
    memcpy = result["memcpy_gbps"]

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)  # trainer ranks set 1 thread themselves
    engine_config = EngineConfig(skip_tokenizer_init=True, context_length=128, max_total_tokens=2048,
                                 mem_fraction_static=0.2, startup_timeout_s=900, request_timeout_s=900,
                                 weight_load_threads=args.engine_load_threads)
    group, rollout = None, None
    runs: dict[tuple[str, int, bool], list] = {}
    try:
        group = TrainerGroup(TrainerSpec(ModelConfig(path=str(model_dir)), TrainerConfig(lr=1e-5)), 2,
                             worker_cls=BenchTrainerWorker)
        raw = ray.get([w.raw_gather_bandwidth.remote(256 << 20) for w in group.workers])[0]
        result["allgather_gbps_gloo_2_ranks"] = raw["all_gather"]
        result["gather_to_rank0_gbps_gloo_2_ranks"] = raw["gather_to_rank0"]
        version, overheads = 0, {}
        # Each mode against an engine launched for it, as `rlsys train` launches it: a serial sync's
        # load takes every core (the trainers wait), a pipelined one's half (ServerSpec.load_threads).
        for pipelined in (False, True):
            spec = ServerSpec(ModelConfig(path=str(model_dir)), engine_config, pipelined_sync=pipelined)
            rollout = RolloutManager.start(spec, 1, str(work / f"logs-{pipelined}"), [{"num_cpus": 1}])
            engine = rollout.fleet.wait_ready()[0]
            for transport in ("colocated", "broadcast"):
                mode = "colocated" if transport == "colocated" else "disaggregated"
                topology = Topology(mode, 2, 1, 1, has_gpu=False, trainers_sleep=False).with_engines([engine])
                group.connect_engines(topology, timeout_s=600)
                if not pipelined:
                    overheads[transport] = ray.get([w.handover_overhead.remote() for w in group.workers])[0]
                for bucket_mb in args.bucket_mb:
                    for _ in range(args.repeats):
                        version += 1
                        runs.setdefault((transport, bucket_mb, pipelined), []).append(ray.get(
                            [w.measured_sync.remote(bucket_mb << 20, version, pipelined) for w in group.workers]))
                        assert rollout.fleet.weight_versions() == [version]
            if pipelined:
                naive = ray.get([w.naive_sync.remote(engine, str(model_dir), str(work / "naive"))
                                 for w in group.workers])[0]
                naive["gbps"] = naive["bytes"] / 1e9 / naive["total_s"]
                result["naive"] = naive
            rollout.shutdown()
            rollout = None
    finally:
        if group is not None:
            group.shutdown()
        if rollout is not None:
            rollout.shutdown()
    for transport in ("colocated", "broadcast"):
        result[transport] = {}
        for bucket_mb in args.bucket_mb:
            side_by_side = {}
            for pipelined in (False, True):
                best = min(runs[transport, bucket_mb, pipelined], key=lambda ranks: ranks[0]["total_s"])  # warm
                side_by_side["pipelined" if pipelined else "serial"] = summarize(best, overheads[transport], memcpy)
            side_by_side["pipelined_over_serial"] = side_by_side["serial"]["total_s"] / side_by_side["pipelined"]["total_s"]
            result[transport][f"{bucket_mb}MB"] = side_by_side
    try:
        if not args.skip_fixed_cost:
            result["fixed_cost_per_sync"] = tiny_model_fixed_cost(work)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    def best(transport: str, mode: str) -> dict:
        return min((r[mode] for r in result[transport].values()), key=lambda r: r["total_s"])

    def speedup(transport: str) -> float:
        return best(transport, "serial")["total_s"] / best(transport, "pipelined")["total_s"]

    fixed = result.get("fixed_cost_per_sync") or {f"{t}_{m}_s": float("nan") for t in ("colocated", "broadcast")
                                                  for m in ("serial", "pipelined")}
    result["checks"] = {
        "colocated_pipelined_total_over_memcpy": best("colocated", "pipelined")["total_over_memcpy"],
        "colocated_serial_total_over_memcpy": best("colocated", "serial")["total_over_memcpy"],
        "colocated_pipelined_over_serial": speedup("colocated"),
        "broadcast_pipelined_over_serial": speedup("broadcast"),
        "colocated_total_speedup_over_naive": result["naive"]["total_s"] / best("colocated", "pipelined")["total_s"],
        "broadcast_total_speedup_over_naive": result["naive"]["total_s"] / best("broadcast", "pipelined")["total_s"],
        "gather_over_raw_gather_to_rank0": best("colocated", "pipelined")["gather_gbps"]
        / result["gather_to_rank0_gbps_gloo_2_ranks"],
        "fixed_cost_colocated_serial_over_pipelined": fixed["colocated_serial_s"] / fixed["colocated_pipelined_s"],
        "fixed_cost_broadcast_serial_over_pipelined": fixed["broadcast_serial_s"] / fixed["broadcast_pipelined_s"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

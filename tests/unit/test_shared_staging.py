"""Shards written straight into the feeding rank's shared staging buffers (2 gloo ranks, spawned,
no Ray): what a slow engine reads at the end of each load is the full tensor, bit for bit, on
every layout a bucket can hold, pipelined and serial, with buffers reused from bucket to bucket;
and no shared-memory file outlives the sync once the buffers are let go of."""

from __future__ import annotations

import base64
import json
import os
import pickle
import time

import pytest
import torch
import torch.multiprocessing as mp

from rlsys.weight_sync.engine_loader import END_OF_SYNC
from tests.helpers import join_gloo_group, meeting_queue

LOAD_S = 0.05  # each load takes this long: a rank writing too early would change what it reads


class _SlowEngine:
    """The colocated transport's endpoints, loading as the engine's loader does: maps the
    handles, takes its time, then copies what the views hold."""

    def __init__(self):
        self.read: dict[str, torch.Tensor] = {}

    def begin_weight_update(self) -> None: ...

    def update_weights_from_tensor(self, serialized_named_tensors, load_format, flush_cache=False,
                                   weight_version=None) -> None:
        mapped = pickle.loads(base64.b64decode(serialized_named_tensors[0]))
        time.sleep(LOAD_S)
        self.read.update({name: tensor.clone() for name, tensor in mapped if name != END_OF_SYNC})

    def end_weight_update(self) -> None: ...


def _full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "even": torch.randn(8, 4, generator=generator),  # 2 even dim-0 shards: each rank writes its own
        "uneven": torch.randn(5, 3, generator=generator),  # not even: gathered by full_tensor
        "vector": torch.randn(6, generator=generator),
        "large": torch.randn(64, 8, generator=generator),  # larger than a bucket: travels alone
        "steps": torch.arange(4, dtype=torch.int64),  # not floating point: keeps its dtype
        "plain": torch.randn(3, 3, generator=generator),  # not a DTensor: the receiver copies it
    }


def _in_wire_dtype(tensor: torch.Tensor, engine_dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(engine_dtype) if engine_dtype is not None and tensor.is_floating_point() else tensor


def _bytes(tensor: torch.Tensor) -> tuple:
    """dtype, shape and raw bytes: equal only bit for bit."""
    return tensor.dtype, tuple(tensor.shape), bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def _scenario(rank: int, queue, shm_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rlsys.system.backend import make_backend
    from rlsys.weight_sync.colocated import ColocatedWeightSender
    from rlsys.weight_sync.shared_staging import SharedStaging
    from rlsys.weight_sync.sync import SyncPlan, sync_weights

    join_gloo_group(rank, 2, queue)
    mesh = init_device_mesh("cpu", (2,))
    full = _full_tensors()
    params = [(name, tensor if name == "plain" else distribute_tensor(tensor, mesh, [Shard(0)]))
              for name, tensor in full.items()]
    before = set(os.listdir(shm_dir))
    results = {}
    for engine_dtype in (None, torch.bfloat16):
        for pipelined in (True, False):
            engine = _SlowEngine()
            sender = ColocatedWeightSender(engine) if rank == 0 else None
            shared = SharedStaging()
            plan = SyncPlan(512, "1", engine_dtype=engine_dtype, pipelined=pipelined, gather_dst=0)
            stats = sync_weights(params, plan, sender, make_backend(False), shared_staging=shared)
            key = f"{engine_dtype}-{pipelined}"
            results[key] = {"gathered_by": stats.gathered_by, "buckets": stats.buckets, "bytes": stats.bytes}
            if rank == 0:
                sender.close()  # drops its staging buffers
                results[key]["bit_equal"] = sorted(
                    name for name, tensor in full.items() if name in engine.read
                    and _bytes(engine.read[name]) == _bytes(_in_wire_dtype(tensor, engine_dtype)))
            shared.release()
            dist.barrier()  # every rank has let go of the buffers
    results["shm_files_left"] = sorted(set(os.listdir(shm_dir)) - before)
    results["pid"] = os.getpid()
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("shared-staging")
    mp.spawn(_scenario, args=(meeting_queue(), "/dev/shm", str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("engine_dtype", ["None", "torch.bfloat16"])
@pytest.mark.parametrize("pipelined", [True, False])
def test_the_engine_reads_every_full_tensor_bit_for_bit(observed, engine_dtype, pipelined):
    receiver, sender = observed[0][f"{engine_dtype}-{pipelined}"], observed[1][f"{engine_dtype}-{pipelined}"]
    assert receiver["bit_equal"] == sorted(_full_tensors())
    assert receiver["gathered_by"] == sender["gathered_by"] == "shared_memory"
    assert receiver["buckets"] == sender["buckets"] >= 3  # buffers taken in turn, each written more than once
    assert receiver["bytes"] > 0 and sender["bytes"] == 0  # only the receiver hands buckets over


def test_no_shared_memory_file_outlives_the_buffers(observed):
    # torch names a shared storage's file torch_<pid of the process that made it>_...: the ranks'
    # own files, not those of any other process on the machine that shares tensors meanwhile
    prefixes = tuple(f"torch_{ranks['pid']}_" for ranks in observed)
    assert [[name for name in ranks["shm_files_left"] if name.startswith(prefixes)] for ranks in observed] == [[], []]

"""A trainer rank's side of the weight sync: its transport to the engines (weight_sync/transports.py;
none on a rank that only joins the gathers), its staging buffers, and what a sync sends."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlsys.actors.loading import is_vision_parameter
from rlsys.actors.lora import merged_parameters
from rlsys.actors.trainer_models import TrainerModels
from rlsys.system.backend import Backend
from rlsys.system.topology import Topology
from rlsys.weight_sync.colocated import StagingBuffer
from rlsys.weight_sync.shared_staging import SharedStaging
from rlsys.weight_sync.sync import SyncPlan, WeightTransport, sync_weights
from rlsys.weight_sync.transports import connect_transport, shared_staging_for


class WeightsOut:
    def __init__(self, backend: Backend):
        self.backend = backend
        self.transport: WeightTransport | None = None  # set by connect (None: this rank only joins the gathers)
        self.gather_dst: int | None = None
        self.shared_staging: SharedStaging | None = None  # set by connect
        self.gather_scratch = StagingBuffer(share_memory=False)  # ranks that only join all-gathers

    def connect(self, topology: Topology, rank: int, world_size: int, timeout_s: float) -> None:
        """This rank's transport as the topology says. Collective (whether the ranks share staging
        buffers). Replaces any earlier transport."""
        self.close()
        self.gather_dst = topology.gather_dst
        self.shared_staging = shared_staging_for(topology, world_size, self.backend)
        self.transport = connect_transport(topology, rank, self.backend, timeout_s)

    def sync(self, models: TrainerModels, freeze_vision: bool, bucket_bytes: int, weight_version: int,
             pipelined: bool, engine_dtype: torch.dtype) -> dict:
        """Gather the weights bucket by bucket and hand them to the transport. Collective."""
        named, merge = engine_parameters(models, freeze_vision)
        plan = SyncPlan(bucket_bytes, str(weight_version), pipelined=pipelined, gather_dst=self.gather_dst,
                        engine_dtype=engine_dtype, pieces=models.checkpoint_pieces)
        return sync_weights(named, plan, self.transport, self.backend, self.gather_scratch, materialize=merge,
                            shared_staging=self.shared_staging).as_dict()

    def release_staging(self) -> None:
        """Drop the staging buffers (a sleeping rank's; the next sync allocates them again)."""
        if self.transport is not None:
            self.transport.release_staging_buffer()
        if self.shared_staging is not None:  # the feeding rank's buffers, freed once no rank maps them
            self.shared_staging.release()
        self.gather_scratch.release()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.shared_staging is not None:
            self.shared_staging.release()


def engine_parameters(models: TrainerModels, freeze_vision: bool
                      ) -> tuple[list[tuple[str, torch.Tensor]], Callable | None]:
    """What a sync sends, under the engine's names (the released checkpoint's: a vision-language
    model's `model.language_model.*` is `model.*` there), and how to materialize each (LoRA's
    merge). A frozen vision tower is left out: the engines loaded it and it never changes."""
    named, merge = (merged_parameters(models.model) if models.lora
                    else (list(models.model.named_parameters()), None))
    if freeze_vision:
        named = [(name, param) for name, param in named if not is_vision_parameter(name)]
    released = models.released_name
    if released is str:
        return named, merge
    trainer_name = {released(name): name for name, _ in named}
    return ([(released(name), param) for name, param in named],
            None if merge is None else lambda name, tensor: merge(trainer_name[name], tensor))

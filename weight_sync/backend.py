"""The one place that decides the hardware backend; every other module asks it.

| GPU                      | CPU twin                                    |
|--------------------------|---------------------------------------------|
| device cuda              | device cpu                                  |
| NCCL process groups      | gloo                                        |
| CUDA IPC handles         | shared-memory handles (file_system strategy)|
| flash-attn varlen        | SDPA                                        |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    has_gpu: bool
    device_type: str  # "cuda" | "cpu"
    dist_backend: str  # "nccl" | "gloo"
    attn_implementation: str  # "flash_attention_2" | "sdpa"

    def device(self, local_rank: int = 0):
        import torch

        if self.has_gpu:
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def prepare_ipc(self) -> None:
        """Make torch's multiprocessing reductions produce handles another process can open.

        On GPU the reductions emit CUDA IPC handles and need nothing. On CPU the default
        file-descriptor strategy fails between unrelated processes, so tensors travel as named
        shared-memory files; this must be set before `share_memory_()`.
        """
        import torch.multiprocessing as mp

        if not self.has_gpu:
            mp.set_sharing_strategy("file_system")


def detect_backend(force_cpu: bool = False) -> Backend:
    import torch

    if not force_cpu and torch.cuda.is_available():
        return Backend(True, "cuda", "nccl", "flash_attention_2")
    return Backend(False, "cpu", "gloo", "sdpa")

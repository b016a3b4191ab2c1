"""The one place that decides the hardware backend; every other module asks it.

| GPU                                      | CPU twin                                     |
|------------------------------------------|----------------------------------------------|
| device cuda                              | device cpu                                   |
| NCCL process groups                      | gloo                                         |
| CUDA IPC handles                         | shared-memory handles (file_system strategy) |
| flash-attn varlen, else torch's varlen   | SDPA per sequence length                     |

Whether the run uses GPUs is decided once, by the driver, from the Ray cluster's resources (the
driver itself often sits on a GPU-less head node); the actors then build their `Backend` from that
decision and check that their own process really sees a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# SDPA attending within each sequence of a packed row (actors/packed_attention.py registers it);
# named here so that choosing it needs no torch import.
PACKED_SDPA = "rlsys_packed_sdpa"
# torch's varlen flash kernel over a packed row (actors/varlen_attention.py): GPUs without flash-attn.
PACKED_VARLEN = "rlsys_packed_varlen"

DeviceChoice = Literal["auto", "cuda", "cpu"]


class BackendError(RuntimeError):
    """The requested hardware is not there (a GPU config on a GPU-less cluster, too few GPUs)."""


@dataclass(frozen=True)
class Backend:
    has_gpu: bool
    device_type: str  # "cuda" | "cpu"
    dist_backend: str  # "nccl" | "gloo"
    attn_implementation: str  # "flash_attention_2" | PACKED_VARLEN | PACKED_SDPA
    gpu_capability: tuple[int, int] | None = None  # this process's GPU's compute capability (None on CPU)

    def device(self, local_rank: int = 0):
        """The process's device. Ray sets CUDA_VISIBLE_DEVICES to the GPU an actor was given, so
        an actor's GPU is always its cuda:0."""
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

    @property
    def ranks_write_into_shared_staging(self) -> bool:
        """Whether the trainer ranks of one node gather a bucket for the rank that feeds the engine
        by writing their shards straight into its staging buffer (host shared memory on CPU, the
        buffer the colocated transport already hands the engine by handle), each rank its own
        shards at once, instead of sending them point-to-point. On CPU that replaces gloo's TCP
        loopback (~5 GB/s here) with the ranks' parallel copies (~15 GB/s into a warm buffer,
        measured on 2 cores); on GPU the shards keep travelling by NCCL."""
        return not self.has_gpu

    def finish_device_writes(self) -> None:
        """Block until this thread's device stream has finished writing (a gathered bucket): another
        process is about to read the memory by IPC handle on a stream of its own, which nothing
        orders after ours. Nothing to wait for on CPU (host collectives return when done)."""
        if self.has_gpu:
            import torch

            torch.cuda.current_stream().synchronize()

    def use_device_on_this_thread(self, device) -> None:
        """CUDA's current device is per thread and a new thread starts on cuda:0: a collective
        launched from a transport's own thread must first select the device its buffers are on."""
        if self.has_gpu and device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    def empty_device_cache(self) -> None:
        """Return the caching allocator's free blocks to the device (after a sleep, so that the
        engine sharing the GPU can use them). Nothing to return on CPU."""
        if self.has_gpu:
            import torch

            # A released staging buffer the engine had opened by CUDA IPC may wait in torch's
            # "limbo" of sent blocks until this collects it (torch.cuda.ipc_collect's contract).
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


    def profiler_activities(self) -> list:
        """What torch.profiler records on this backend: host ops always, CUDA kernels and copies
        (through CUPTI) on a GPU."""
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if self.has_gpu else [ProfilerActivity.CPU]

    def held_memory_bytes(self) -> int:
        """Memory this process holds on its device: the caching allocator's reservation on GPU
        (what another process on the GPU cannot use), the resident set on CPU (host is the device)."""
        if self.has_gpu:
            import torch

            torch.cuda.synchronize()
            return int(torch.cuda.memory_reserved())
        import psutil

        return int(psutil.Process().memory_info().rss)


def choose_attention(has_gpu: bool, compute_dtype: str, flash_attn_available: bool,
                     torch_varlen_available: bool = False) -> str:
    """The trainer's attention for packed rows: a flash kernel where one runs, else SDPA.

    | GPU | compute dtype     | flash-attn installed | torch varlen (sm80+) | attention                  |
    |-----|-------------------|----------------------|----------------------|----------------------------|
    | no  | any               | any                  | any                  | packed SDPA                |
    | yes | float32           | any                  | any                  | packed SDPA (flash: 16-bit)|
    | yes | bfloat16, float16 | yes                  | any                  | flash_attention_2          |
    | yes | bfloat16, float16 | no                   | yes                  | packed varlen              |
    | yes | bfloat16, float16 | no                   | no                   | packed SDPA                |

    Packed SDPA (`actors/packed_attention.py`) is SDPA that attends within each sequence of a
    packed row instead of through a pack-length mask, one call per distinct length; flash-attn's
    varlen kernels, and torch's own (`actors/varlen_attention.py`), take the whole row in one call.
    """
    if has_gpu and compute_dtype in ("bfloat16", "float16"):
        if flash_attn_available:
            return "flash_attention_2"
        if torch_varlen_available:
            return PACKED_VARLEN
    return PACKED_SDPA


def torch_varlen_available(gpu_capability: tuple[int, int] | None) -> bool:
    """Whether torch's varlen flash attention runs here: `torch.nn.attention.varlen` in this torch
    (2.10 and later) and a GPU of compute capability 8.0 or newer (torch's flash kernels are built
    for sm80 and up)."""
    import importlib.util

    if gpu_capability is None or gpu_capability < (8, 0):
        return False
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ModuleNotFoundError:
        return False


# Head dimensions torch's CUDA flash kernels take: a multiple of 8, at most 256.
FLASH_MAX_HEAD_DIM = 256


def cuda_flash_takes(query) -> bool:
    """Whether torch's CUDA flash kernels take these queries (the packed varlen attention's and the
    ring's blocks ask): on a CUDA device of compute capability 8.0 or newer, 16-bit, a head
    dimension (the last) that is a multiple of 8 and at most FLASH_MAX_HEAD_DIM."""
    import torch

    head_dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= FLASH_MAX_HEAD_DIM and torch.cuda.get_device_capability(query.device) >= (8, 0))


# SGLang attention backends that compute a float32 model in float32. Left unset, SGLang 0.5.23
# picks by GPU (sglang/srt/arg_groups/model_override_base.py: get_default_attn_backend, MHA
# models): fa3 on Hopper (sm90), trtllm_mha or fa4 on sm100, aiter on ROCm, else flashinfer when
# installed, else triton. fa3, fa4, trtllm_mha and flashinfer take fp16/bf16 (fp8) only, and
# triton's tl.dot runs fp32 inputs as tf32 (10-bit mantissa): none computes what an fp32 trainer
# computes. torch_native is SDPA, the trainer's own fp32 kernel; SGLang turns CUDA graphs off for
# it (sglang/srt/arg_groups/attention_hook.py: handle_attention_backend_compatibility).
SDPA_ENGINE_ATTENTION = "torch_native"


def engine_dtype(has_gpu: bool, model_dtype: str) -> str:
    """The dtype an engine serves in (its --dtype), and so the dtype the weight sync casts to and
    the weight check's rounding bound: the engine launcher and the trainer's sync both ask this.

    | GPU | model.dtype | engine dtype                                                      |
    |-----|-------------|-------------------------------------------------------------------|
    | no  | float32     | float32 (SGLang's CPU kernels take it; the tests' exact checks)   |
    | no  | bfloat16    | bfloat16                                                          |
    | yes | float32     | bfloat16: an fp32 trainer feeds a bf16 engine (as verl and slime) |
    | yes | bfloat16    | bfloat16                                                          |

    Why no fp32 engine on a GPU: SGLang 0.5.23's CUDA RMSNorm (sglang/srt/layers/layernorm.py,
    RMSNorm.forward_cuda) calls sgl_kernel's `rmsnorm` for a norm without residual (every decoder's
    first input norm), and that kernel (flashinfer's norm.cu) dispatches fp16/bf16 only
    (DISPATCH_*_DTYPE_TO_CTYPE_FP16): an fp32 engine fails at its first forward. The trainer keeps
    its fp32 master weights and compute; the sync casts each bucket to bf16.
    """
    return "bfloat16" if has_gpu else model_dtype


def engine_attention_backend(has_gpu: bool, dtype: str, gpu_capability: tuple[int, int] | None) -> str | None:
    """The engine's --attention-backend for its `engine_dtype`; None leaves SGLang's own choice.

    | GPU           | engine dtype | attention backend                                         |
    |---------------|--------------|-----------------------------------------------------------|
    | no            | any          | torch_native (SGLang's CPU path)                          |
    | any           | float32      | torch_native (every GPU default is 16-bit only, or tf32)  |
    | sm80 or newer | bfloat16     | SGLang's default (fa3 on sm90, trtllm_mha on sm100, ...)  |
    | before sm80   | bfloat16     | torch_native (flashinfer's and triton's bf16 need sm80)   |

    (`engine_dtype` never gives a GPU engine float32; the row stays for an engine launched by hand.)
    """
    if not has_gpu or dtype == "float32":
        return SDPA_ENGINE_ATTENTION
    if gpu_capability is not None and gpu_capability < (8, 0):
        return SDPA_ENGINE_ATTENTION
    return None


def flash_attn_available() -> bool:
    """Whether transformers will run flash_attention_2 in this process: its own check (the
    `flash-attn` distribution, version >= 2.3.3, and a CUDA device), which the trainer ranks' attention
    choice, the memory plan and each node's check (rlsys/system/node_checks.py) all ask, so that
    they cannot disagree with the model load."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def make_backend(has_gpu: bool, compute_dtype: str = "float32") -> Backend:
    """The backend of an actor of a run that `decide_has_gpu` judged; fails clearly when the run
    uses GPUs but this process was given none (e.g. an actor scheduled without `num_gpus`)."""
    if has_gpu:
        import torch

        if not torch.cuda.is_available():
            raise BackendError("this run uses GPUs but this process sees none (CUDA_VISIBLE_DEVICES="
                               f"{__import__('os').environ.get('CUDA_VISIBLE_DEVICES')!r})")
        capability = tuple(torch.cuda.get_device_capability())
        return Backend(True, "cuda", "nccl", choose_attention(True, compute_dtype, flash_attn_available(),
                                                              torch_varlen_available(capability)),
                       gpu_capability=capability)
    return Backend(False, "cpu", "gloo", choose_attention(False, compute_dtype, False))


def decide_has_gpu(device: DeviceChoice, cluster_gpus: float, gpus_needed: float) -> bool:
    """Whether the run uses GPUs, from the cluster's resources (never the driver's own devices).

    auto: GPUs when the cluster has any; cuda: GPUs, or a clear error; cpu: never. With GPUs, the
    cluster must hold the placement's GPUs, or its placement group would wait for ever.
    """
    if device == "cpu":
        return False
    if cluster_gpus <= 0:
        if device == "cuda":
            raise BackendError("placement.device is cuda but the Ray cluster has no GPUs "
                               "(ray.cluster_resources() lists none); start GPU workers or set placement.device=cpu")
        return False
    if cluster_gpus < gpus_needed:
        raise BackendError(f"the placement needs {gpus_needed:g} GPUs but the Ray cluster has {cluster_gpus:g}; "
                           "lower trainer.num_ranks / rollout.num_engines / rollout.engine.tp_size, add GPUs, "
                           "or set placement.device=cpu")
    return True


def cluster_gpus() -> float:
    """GPUs in the Ray cluster this process is connected to (after `ray.init`)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0))

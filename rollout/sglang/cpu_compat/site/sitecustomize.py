"""rlsys CPU compatibility layer for the SGLang server, loaded only on machines without a GPU.

`rlsys.rollout.sglang.server` puts this directory first on the SGLang server's PYTHONPATH when no CUDA
device is present; Python then imports this file at start-up in the server process.

First it checks that the installed SGLang is the release the layer was written for
(`rlsys_fence.SGLANG_VERSION`) and ends the process with one message if not. Then it installs two
patches the server needs to run with `--device cpu` at all:

1. `sgl_kernel` (SGLang's compiled kernel package) is CUDA-only and cannot be imported without
   libcuda. On a CPU without AMX, SGLang's CPU path uses plain torch layers and never calls those
   kernels, but modules import their names. We install an import hook that provides a top-level
   `sgl_kernel` stand-in that has exactly the names SGLang's CPU path imports
   (`rlsys_fence.SGL_KERNEL_CPU_NAMES`), each a function raising a clear error if it is ever
   called; any other name raises AttributeError, so `hasattr` checks tell the truth. Its
   submodules stay absent (ImportError), so SGLang's own fallbacks for them apply.
2. `torch.cuda.synchronize()` is called by `/release_memory_occupation` through the device
   module and dies on a CUDA build of torch without a driver. With no GPU there is nothing to
   synchronise, so it becomes a no-op.
1b. Some SGLang model modules bind ops of that kernel library from `torch.ops.sgl_kernel` under
   their `if _is_cpu:` branches when imported (`rlsys_fence.SGL_KERNEL_OPS_READ_AT_IMPORT`:
   models/qwen3_5.py, which the Qwen-VL image processor imports). `torch.ops.sgl_kernel` becomes a
   stand-in that has those names, each raising if called, and otherwise answers as the real
   namespace does (no op registered: AttributeError, so SGLang's AMX checks stay false).
2c. Per-request sampling seeds (`rlsys_seeded_sampling`): SGLang samples with a request's
   `sampling_seed` only under --enable-deterministic-inference, which refuses the CPU's attention
   backend, and hashes through a kernel op CPU installs lack; every batch gets its seed tensor, the
   hash is plain torch (bit for bit SGLang's), and the filtered path's noise is indexed by token id.
   Required, not a speed-up: rlsys's samples depend on it (rollout/seeds.py).
2b. SGLang allocates host buffers (the routed-experts capturer's, which routing replay's
   `--enable-return-routed-experts` turns on) pinned and registered with cudaHostRegister
   (`mem_cache/pool_host/common.py` `alloc_with_host_register`), which initialises CUDA and dies
   without a driver. Pinning only speeds up copies from a GPU, so without one the "cpu" entry of
   its `ALLOC_MEMORY_FUNCS` allocates plain memory (`_unpinned_host_memory`).

and five speed-ups, off with RLSYS_SGLANG_CPU_SPEEDUPS=0 (`rlsys_fence.SPEEDUPS_ENV`). Those that
replace an SGLang method first check that the method still has the parameters its replacement
was written with (`rlsys_fence.check_signature`), when SGLang imports its module during start-up,
and end the process with one message if not:

3. The torch_native attention backend's decode and prefill attend one request at a time in a
   Python loop; when SGLang imports it, `rlsys_batched_decode` replaces that loop with one batched
   SDPA call (the same attention up to summation order).
4. SGLang starts its scheduler and detokenizer processes with multiprocessing's "spawn", because
   a forked child cannot use a CUDA context its parent created. Without a GPU there is no CUDA
   context, so they are forked instead: a forked child starts with the server's imports (torch,
   sglang, transformers) already done, where a spawned one imports them all again while its
   siblings do the same on the same cores. Start-up of a tiny model's server here: 19 s -> 9.5 s.
   The children inherit this module's import hooks, so (1) and (3) hold in them too (spawned
   children run this file again).
5. SGLang's server checks for a SIGTERM every 5 s before it shuts down, and its idle scheduler
   finishes a 1 s sleep before it acts on the shutdown request; `rlsys_prompt_shutdown` makes the
   first 0.1 s and skips the second, so stopping an engine (at the end of every run, and at every
   engine restart) no longer waits up to 6 s.
6. SGLang modules call `torch.compile` at import, which sets up TorchDynamo at once (~1.2 s of
   a server's start) for kernels a CPU never runs; `rlsys_lazy_compile` defers that set-up to a
   compiled function's first call (compilation itself was already deferred to it).

7. A vision tower's rotary embedding (layers/attention/vision.py `apply_rotary_pos_emb`) is
   `torch.compile`d with Inductor, which on a CPU compiles C++ at a VLM server's first image (70.8 s
   of a tiny Qwen2.5-VL's first request on 2 cores); the module's own eager twin,
   `apply_rotary_pos_emb_native_eager` (the same operations, which SGLang uses under a ViT CUDA
   graph), is used instead: the first request took 0.2 s, its log-probs the same to the bit.

Last, it runs the `sitecustomize` this file shadows (the next one on sys.path, e.g. a venv's or a
distribution's), as Python would have without it.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import rlsys_fence

_STANDIN_ROOT = "sgl_kernel"
# Speed-ups (3, 5): SGLang methods replaced once their module has executed: module name -> (class,
# method, rlsys module, wrapper), where wrapper(original method) returns the replacement, with the
# original's parameters.
_SPEEDUP_PATCHES = {
    "sglang.srt.layers.attention.torch_native_backend": [
        ("TorchNativeAttnBackend", "_run_sdpa_forward_decode", "rlsys_batched_decode", "batched_decode"),
        ("TorchNativeAttnBackend", "_run_sdpa_forward_extend", "rlsys_batched_decode", "batched_extend"),
    ],
    "sglang.srt.managers.tokenizer_manager": [
        ("TokenizerManager", "sigterm_watchdog", "rlsys_prompt_shutdown", "watch_sigterm_often"),
    ],
    "sglang.srt.managers.scheduler": [
        ("Scheduler", "maybe_sleep_on_idle", "rlsys_prompt_shutdown", "skip_idle_sleep_when_exiting"),
    ],
}


# Speed-up (7): module functions replaced by another function of the same module, once it has
# executed: module name -> (global, the global to use instead).
_SPEEDUP_GLOBALS = {
    "sglang.srt.layers.attention.vision": [("apply_rotary_pos_emb", "apply_rotary_pos_emb_native_eager")],
}


def _use_instead(module, name: str, instead: str) -> None:
    """`module.name` (and every entry of a module-level dict that holds it) becomes `module.instead`,
    which must take the same parameters."""
    original, replacement = getattr(module, name, None), getattr(module, instead, None)
    if original is None or replacement is None:
        raise rlsys_fence.SGLangMismatch(
            f"rlsys's CPU layer uses {module.__name__}.{instead} for {name}, written for "
            f"sglang=={rlsys_fence.SGLANG_VERSION}; the installed sglang {rlsys_fence.installed_sglang_version()} "
            f"has no {name if original is None else instead}. Install sglang=={rlsys_fence.SGLANG_VERSION}, or set "
            f"{rlsys_fence.SPEEDUPS_ENV}=0 to run without the CPU speed-ups.")
    rlsys_fence.check_signature(f"{module.__name__}.{name}", original, replacement)
    setattr(module, name, replacement)
    for value in list(vars(module).values()):
        if isinstance(value, dict):
            for key, entry in list(value.items()):
                if entry is original:
                    value[key] = replacement


def _replace_once(module, class_name: str, method: str, patcher: str, wrapper: str) -> None:
    """`class.method` = wrapper(original), keeping the original as `rlsys_original` (tests compare
    against it); a method already replaced is left alone."""
    owner = getattr(module, class_name)
    original = getattr(owner, method)
    if hasattr(original, "rlsys_original"):
        return
    replacement = getattr(importlib.import_module(patcher), wrapper)(original)
    rlsys_fence.check_signature(f"{class_name}.{method}", original, replacement)
    replacement.rlsys_original = original
    setattr(owner, method, replacement)


def _raise_not_available(qualified_name):
    def _kernel(*args, **kwargs):
        raise RuntimeError(
            f"{qualified_name} is a CUDA kernel from sgl_kernel and was called on a machine "
            "without a GPU; rlsys's CPU compatibility layer (rollout/sglang/cpu_compat) provides only "
            "a stand-in. Run on a GPU or report which SGLang code path called it."
        )

    _kernel.__name__ = qualified_name.rsplit(".", 1)[-1]
    return _kernel


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name not in rlsys_fence.SGL_KERNEL_CPU_NAMES:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (rlsys's CPU stand-in for "
                                 "sgl_kernel has only the names SGLang's CPU path imports)")
        return _raise_not_available(f"{self.__name__}.{name}")


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__version__ = "0.0.0+rlsys-cpu-standin"
        return module

    def exec_module(self, module):
        return None


class _StandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _STANDIN_ROOT:
            return importlib.machinery.ModuleSpec(fullname, _StandInLoader())
        return None


def _spec_patched_after_exec(fullname, path, patch):
    """`fullname`'s spec as Python would find it, whose module is passed to `patch` once it has executed."""
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    execute = spec.loader.exec_module

    def exec_module(module):
        execute(module)
        patch(module)

    spec.loader.exec_module = exec_module
    return spec


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds a module of `_SPEEDUP_PATCHES` or `_SPEEDUP_GLOBALS` as usual, then patches it once it has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _SPEEDUP_PATCHES and fullname not in _SPEEDUP_GLOBALS:
            return None

        def patch(module):
            try:
                for replacement in _SPEEDUP_PATCHES.get(fullname, ()):
                    _replace_once(module, *replacement)
                for name, instead in _SPEEDUP_GLOBALS.get(fullname, ()):
                    _use_instead(module, name, instead)
            except rlsys_fence.SGLangMismatch as error:
                rlsys_fence.refuse(error)

        return _spec_patched_after_exec(fullname, path, patch)


def _fork_instead_of_spawn():
    """SGLang calls multiprocessing.set_start_method("spawn", force=True) before it starts its
    children; on a machine without CUDA, "fork" is used instead (see (4) above)."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def _set_start_method(method, force=False):
        return set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = _set_start_method


def _run_shadowed_sitecustomize():
    """Runs the next `sitecustomize` on sys.path after this directory, which this file hides from
    Python; an error in it is reported as Python reports one in a sitecustomize, and start-up goes on."""
    here = os.path.realpath(os.path.dirname(__file__))
    entries = [os.path.realpath(entry or os.curdir) for entry in sys.path]
    if here not in entries:
        return
    later = [entry for entry, real in zip(sys.path[entries.index(here) + 1:], entries[entries.index(here) + 1:],
                                          strict=True) if real != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None:
        return
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as error:
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n"
                         f"{type(error).__name__}: {error}\n")
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())


_HOST_MEMORY_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _unpinned_host_memory(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """(2b): `alloc_with_host_register`'s parameters, plain host memory."""
    import torch

    return torch.empty(dims, dtype=dtype, device="cpu")


class _UnpinnedHostMemory(importlib.abc.MetaPathFinder):
    """Finds `_HOST_MEMORY_MODULE` as usual, then points its "cpu" allocator at `_unpinned_host_memory`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _HOST_MEMORY_MODULE:
            return None
        return _spec_patched_after_exec(
            fullname, path, lambda module: module.ALLOC_MEMORY_FUNCS.__setitem__("cpu", _unpinned_host_memory))


def _seed_every_batch(module) -> None:
    import rlsys_seeded_sampling

    owner = module.SamplingBatchInfo
    original = owner.from_schedule_batch.__func__
    replacement = rlsys_seeded_sampling.always_seeded(original)
    rlsys_fence.check_signature("SamplingBatchInfo.from_schedule_batch", original, replacement, speedup=False)
    owner.from_schedule_batch = classmethod(replacement)


def _hash_in_torch(module) -> None:
    import rlsys_seeded_sampling

    replacements = {
        "multinomial_with_seed": rlsys_seeded_sampling.multinomial_with_seed,
        "top_k_top_p_min_p_sampling_from_probs_torch":
            rlsys_seeded_sampling.seeded_filtered_sampling(module.top_k_top_p_min_p_sampling_from_probs_torch),
    }
    for name, replacement in replacements.items():
        rlsys_fence.check_signature(f"{module.__name__}.{name}", getattr(module, name), replacement, speedup=False)
        setattr(module, name, replacement)


_SEEDED_SAMPLING = {  # (2c): module -> its patch
    "sglang.srt.sampling.sampling_batch_info": _seed_every_batch,
    "sglang.srt.layers.sampler": _hash_in_torch,
}


class _SeededSampling(importlib.abc.MetaPathFinder):
    """Finds a module of `_SEEDED_SAMPLING` as usual, then patches it once it has executed (2c)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _SEEDED_SAMPLING:
            return None
        def patch_or_refuse(module):
            try:
                _SEEDED_SAMPLING[fullname](module)
            except rlsys_fence.SGLangMismatch as error:
                rlsys_fence.refuse(error)

        return _spec_patched_after_exec(fullname, path, patch_or_refuse)


class _StandInOps:
    """(1b): `torch.ops.sgl_kernel` with the ops `rlsys_fence.SGL_KERNEL_OPS_READ_AT_IMPORT` names."""

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):
        if name in rlsys_fence.SGL_KERNEL_OPS_READ_AT_IMPORT:
            return _raise_not_available(f"torch.ops.sgl_kernel.{name}")
        return getattr(self._namespace, name)


def _install_required(torch):
    """(1), (1b), (2), (2b) and (2c): what the server needs to run without a GPU at all."""
    sys.meta_path.insert(0, _StandInFinder())
    if torch is not None and not torch.cuda.is_available():
        torch.ops.sgl_kernel = _StandInOps(torch.ops.sgl_kernel)
        torch.cuda.synchronize = lambda *args, **kwargs: None
        sys.meta_path.insert(0, _UnpinnedHostMemory())
        sys.meta_path.insert(0, _SeededSampling())


def _install_speedups(torch):
    """(3) to (7): faster, same results; RLSYS_SGLANG_CPU_SPEEDUPS=0 leaves them out."""
    if torch is None or torch.cuda.is_available():
        return
    from rlsys_lazy_compile import defer_dynamo_setup

    torch.compile = defer_dynamo_setup(torch.compile)
    sys.meta_path.insert(0, _PatchAfterImport())
    _fork_instead_of_spawn()


def _install():
    try:
        rlsys_fence.check_version(rlsys_fence.installed_sglang_version())
    except rlsys_fence.SGLangMismatch as error:
        rlsys_fence.refuse(error)
    try:
        import torch
    except ImportError:
        torch = None
    _install_required(torch)
    if os.environ.get(rlsys_fence.SPEEDUPS_ENV, "1") != "0":
        _install_speedups(torch)
    _run_shadowed_sitecustomize()


_install()

"""Launch and stop a real `sglang.launch_server` process.

The CPU compatibility layer (rollout/sglang/cpu_compat) is put on the server's path here, and only when
the backend has no GPU; everything else is the same command a GPU run uses.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlsys.config import EngineConfig, ModelConfig
from rlsys.rollout.sglang.client import EngineAddress, EngineError, SGLangClient, read_log_tail
from rlsys.rollout.sglang.cpu_compat.site.rlsys_fence import REFUSAL_MARK
from rlsys.system.backend import Backend, engine_attention_backend, engine_dtype
from rlsys.system.interrupts import take_sigterm_again
from rlsys.system.node import gloo_interface_env
from rlsys.weight_sync import engine_loader

logger = logging.getLogger(__name__)

# Launches of a server whose HTTP port another socket took before it could bind it (SGLangServer.start).
PORT_ATTEMPTS = 3
# Shared-memory files SGLang's processes create (load slots, segments, multiprocessing semaphores).
_SGLANG_SHM_PREFIXES = ("/dev/shm/sglang_", "/dev/shm/sgl_shm", "/dev/shm/sem.mp-")
CPU_COMPAT_SITE = Path(__file__).resolve().parent / "cpu_compat" / "site"


@dataclass(frozen=True)
class ServerSpec:
    """One SGLang server: the run config's model and engine sections, nothing copied."""

    model: ModelConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0
    has_gpu: bool = False  # decided by the driver from the cluster's resources (rlsys/system/backend.py)
    memory_saver: bool = False  # gives its memory back between rollouts (colocated, sleeping trainers)
    radix_cache: bool = True  # RolloutConfig.uses_radix_cache
    # Processes of the run computing on the engine's node while it generates (Topology.cpu_sharers);
    # its threads are the node's cores over this. None (standalone engines): one thread.
    cpu_sharers: int | None = None
    pipelined_sync: bool = True  # weight_sync.pipelined: the trainers gather the next bucket during a load
    # rollout.routing_replay: the server records which experts it routed each token to and returns them
    # (SGLang's --enable-return-routed-experts, a request's return_routed_experts)
    return_routes: bool = False
    env: dict[str, str] = field(default_factory=dict)  # placement.env: the collectives' settings (NCCL_*, ...)

    @property
    def dtype(self) -> str:
        """The dtype the server runs in (rlsys/system/backend.py: engine_dtype; bf16 on a GPU)."""
        return engine_dtype(self.has_gpu, self.model.dtype)

    @property
    def startup_timeout_s(self) -> float:
        return self.engine.startup_timeout(self.has_gpu)

    def threads(self, node_cores: int) -> int:
        if self.engine.threads is not None:
            return self.engine.threads
        return max(1, node_cores // self.cpu_sharers) if self.cpu_sharers else 1

    def load_threads(self, node_cores: int) -> int:
        """Threads of a colocated sync's host copy (weight_sync/engine_loader.py). Serial syncs
        leave the trainers waiting, so the copy takes every core; pipelined ones gather the next
        bucket meanwhile, so it takes half (measured on 2 cores, bench/weight_sync.py: with both
        cores the load slowed the overlapping gather so much that the pipelined sync lost)."""
        if self.engine.weight_load_threads is not None:
            return self.engine.weight_load_threads
        return max(1, node_cores // 2) if self.pipelined_sync else node_cores


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # If the engine actor is killed, the server gets SIGTERM and tears down its own children. The
    # actor inherited SIGTERM blocked from the local Ray cluster (rlsys.system.interrupts); the server, in a
    # session of its own that no group signal reaches, is stopped with it.
    take_sigterm_again()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setsid()


def _wait_for_group_exit(group_id: int, grace_s: float) -> None:
    """Wait until no process of the process group is left, or `grace_s` passes."""
    import psutil

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        members = []
        for process in psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(process.pid) == group_id and process.info["status"] != psutil.STATUS_ZOMBIE:
                    members.append(process.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        if not members:
            return
        time.sleep(0.05)


def _mapped_files(pid: int) -> set[str]:
    """Paths of the files process `pid` maps, from /proc/<pid>/maps: psutil's memory_maps() parses
    the much longer smaps (~25 ms per torch process against 1 ms; three per engine, at every
    start and stop). An exited process maps nothing."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    # address perms offset dev inode [path]; a path may itself contain spaces
    return {fields[5] for fields in (line.split(maxsplit=5) for line in lines) if len(fields) == 6}


def api_key_in(extra_args: list[str]) -> str | None:
    """The `--api-key` a user put in rollout.engine.extra_args, if any."""
    for index, arg in enumerate(extra_args):
        if arg == "--api-key" and index + 1 < len(extra_args):
            return extra_args[index + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return None


def build_command(spec: ServerSpec, backend: Backend, host: str, port: int, api_key: str | None = None) -> list[str]:
    engine = spec.engine
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", spec.model.path,
        "--host", host,
        "--port", str(port),
        "--dtype", spec.dtype,  # always explicit: `auto` gave an fp16 KV cache on fp32 weights
        "--tp-size", str(engine.tp_size),
        "--mem-fraction-static", str(engine.mem_fraction_static),
        "--max-total-tokens", str(engine.max_total_tokens),
        "--context-length", str(engine.context_length),
        "--random-seed", str(spec.seed),
        "--skip-server-warmup",
        "--weight-version", "0",
        # The colocated transport loads its buckets through our loader, and an attached run restarts the
        # engine's random streams through the second (weight_sync/engine_loader.py).
        "--custom-weight-loader", engine_loader.LOAD_FORMAT, engine_loader.SEED_LOAD_FORMAT,
    ]
    if api_key and api_key_in(engine.extra_args) is None:
        # The server listens on its node's address: every request, weight updates included, must
        # carry the run's key (SGLang's add_api_key_middleware; /health and /metrics stay open).
        # One token with `=`: a key beginning with "-" (secrets.token_urlsafe gives one in 64) would be
        # read by argparse as an option and SGLang would refuse to start.
        command.append(f"--api-key={api_key}")
    if not spec.radix_cache:
        command.append("--disable-radix-cache")
    if spec.return_routes:
        command.append("--enable-return-routed-experts")
    if engine.skip_tokenizer_init:
        command.append("--skip-tokenizer-init")
    elif spec.model.tokenizer_path:
        command += ["--tokenizer-path", spec.model.tokenizer_path]
    if spec.memory_saver and backend.has_gpu:
        # torch_memory_saver (CUDA only) makes /release_memory_occupation really return the
        # weights' and KV cache's memory to the GPU while the colocated trainer trains. On CPU the
        # same endpoints answer without it (they pause the regions, freeing nothing).
        command.append("--enable-memory-saver")
    if not backend.has_gpu:
        # Without --sleep-on-idle the idle CPU scheduler spins a core at 100%. The overlap
        # scheduler prepares the next batch in a second thread while the GPU computes; on a CPU
        # both threads compute on the same cores under one GIL, so it only adds switching
        # (64 x 4 tokens on the tiny model: 3 ms of 50 ms).
        command += [
            "--device", "cpu",
            "--disable-cuda-graph",
            "--sleep-on-idle",
            "--disable-overlap-schedule",
        ]
    attention = engine_attention_backend(backend.has_gpu, spec.dtype, backend.gpu_capability)
    if attention is not None:  # else SGLang's default for the GPU, which takes this dtype
        command += ["--attention-backend", attention]
    return command + list(engine.extra_args)


SERVED_MODEL_PACKAGE = "rlsys.rollout.sglang.served_model"
SERVED_MODEL_CLASS_ENV = "RLSYS_SGLANG_MODEL_CLASS"


def served_model_class(model_path: str) -> str | None:
    """"module:Class" of the SGLang model class for the model's architecture (its config.json's
    first), found by the class statement in SGLang's model sources without importing them; None
    when there is no single such class (SGLang then resolves the architecture its own way)."""
    import importlib.util

    try:
        architecture = json.loads((Path(model_path) / "config.json").read_text())["architectures"][0]
        sglang = importlib.util.find_spec("sglang")  # finds the package without importing it
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    if sglang is None or sglang.origin is None:
        return None
    modules = [source.stem for source in sorted((Path(sglang.origin).parent / "srt" / "models").glob("*.py"))
               if _defines_entry_class(source.read_text(errors="replace"), architecture)]
    return f"sglang.srt.models.{modules[0]}:{architecture}" if len(modules) == 1 else None


def _defines_entry_class(source: str, name: str) -> bool:
    """The module defines class `name` and lists it in its `EntryClass` (what SGLang registers)."""
    return f"class {name}(" in source and re.search(rf"\b{name}\b", source.rpartition("EntryClass")[2]) is not None


def nvml_device_keys(visible: str | None, device_count: int) -> list[int | str]:
    """The GPUs a process may use, as NVML lookup keys: indexes (ints) or UUIDs ('GPU-...', 'MIG-...').

    `visible` is CUDA_VISIBLE_DEVICES (Ray sets it per actor to its GPU ids, which it numbers as
    NVML does); unset means every device. CUDA stops at the first entry it cannot use, so does this."""
    if visible is None:
        return list(range(device_count))
    keys: list[int | str] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < device_count:
            keys.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            keys.append(entry)
        else:
            break
    if not keys:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names no usable GPU")
    return keys


def build_env(spec: ServerSpec, backend: Backend, host: str = "127.0.0.1") -> dict[str, str]:
    env = dict(os.environ)
    env.update(spec.env)
    env.update(gloo_interface_env(host, env))  # its weight-update group spans nodes (rlsys/system/node.py)
    served = served_model_class(spec.model.path)
    if served is not None and "SGLANG_EXTERNAL_MODEL_PACKAGE" not in env:
        # SGLang then imports this one model module at start-up, not all ~150 (served_model/).
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = SERVED_MODEL_PACKAGE
        env[SERVED_MODEL_CLASS_ENV] = served
    if not backend.has_gpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # --device cpu alone does not select the CPU path
        path = [str(CPU_COMPAT_SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(path)
    # A vision-language model's image features would be served from SGLang's embedding cache, keyed
    # by the image alone and kept across weight updates: its flush_cache (managers/scheduler.py)
    # resets the KV and radix caches, not this one (managers/mm_schedule.py `embedding_cache`), so an
    # image seen before a sync would be encoded by the old vision tower. Size 0 caches nothing.
    env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    cores = len(os.sched_getaffinity(0))
    # The scheduler's torch takes its thread count from OMP_NUM_THREADS at start.
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(spec.threads(cores))
    env[engine_loader.LOAD_THREADS_ENV] = str(spec.load_threads(cores))
    return env


class SGLangServer:
    """One `sglang.launch_server` child process, its log file, and its URL.

    `host` is where it listens: its node's address when trainers on other nodes talk to it
    (RolloutEngine passes Ray's node IP). It then answers only requests that carry its API key
    (a fresh one per server unless rollout.engine.extra_args sets `--api-key`)."""

    def __init__(self, spec: ServerSpec, backend: Backend, name: str, log_path: Path, host: str = "127.0.0.1"):
        self.spec = spec
        self.backend = backend
        self.host = host
        self.port = find_free_port(host)
        self.log_path = Path(log_path)
        self.api_key = api_key_in(spec.engine.extra_args) or secrets.token_urlsafe(24)
        self.address = EngineAddress(name, f"http://{host}:{self.port}", str(self.log_path), spec.engine.tp_size,
                                     api_key=self.api_key)
        self.client = SGLangClient(self.address, timeout_s=spec.engine.request_timeout_s)
        self._process: subprocess.Popen | None = None
        self._owned_shm: set[str] = set()
        self._log_start = 0

    @property
    def url(self) -> str:
        return self.address.url

    def start(self, timeout_s: float) -> None:
        """Launch the server and wait until it answers. The port was free when chosen, but the server
        binds it only after its ~10 s of imports, and any socket on the node may take it meanwhile
        (an outgoing connection's local port comes from the same ephemeral range): a server that
        exits because its port is in use is launched again on a new one, up to PORT_ATTEMPTS times."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._launch()
            try:
                return self._wait_healthy(deadline - time.monotonic())
            except RuntimeError:
                if attempt == PORT_ATTEMPTS or not self._port_was_taken():
                    raise
            logger.warning("%s: port %d was taken while the server started; launching it again on another",
                           self.address.name, self.port)
            self.stop(grace_s=1.0)  # what is left of its process group
            self._use_port(find_free_port(self.host))

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")
        self._log_start = log_file.tell()  # the log is appended to across restarts
        self._process = subprocess.Popen(
            build_command(self.spec, self.backend, self.host, self.port, self.api_key),
            env=build_env(self.spec, self.backend, self.host),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        log_file.close()

    def _use_port(self, port: int) -> None:
        self.port = port
        self.address = replace(self.address, url=f"http://{self.host}:{port}")
        self.client.address = self.address  # the same client object: RolloutEngine holds it

    def _port_was_taken(self) -> bool:
        """Whether this launch's log says its HTTP port was in use (uvicorn's bind error)."""
        bind_error = f"error while attempting to bind on address ('{self.host}', {self.port})"
        return any(bind_error in line and "address already in use" in line for line in self._log_lines())

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                refusal = self._cpu_layer_refusal()
                raise RuntimeError(
                    f"SGLang server exited with code {self._process.returncode} during start-up"
                    f"{': ' + refusal if refusal else ''}; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                self.client.model_info(timeout_s=2.0)
            except EngineError:
                time.sleep(0.1)  # polls are cheap (a refused connection); the engine is the start-up's critical path
                continue
            self._owned_shm = self._shared_memory_files()  # removed at stop, even after a crash
            self._freeze_gc()
            return
        self.stop()
        raise TimeoutError(
            f"SGLang server at {self.url} was not healthy after {timeout_s:.0f}s "
            f"(rollout.engine.startup_timeout_s); last lines of {self.log_path}:\n{self.log_tail()}"
        )

    @property
    def pid(self) -> int | None:
        """The server's process (the head of its process tree), while it runs."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def still_running_after(self, seconds: float) -> bool:
        """Whether the server is still running `seconds` from now (False as soon as it has exited)."""
        deadline = time.monotonic() + seconds
        while self.is_alive():
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.05)
        return False

    def memory_bytes(self) -> int | None:
        """Resident memory of the server and its scheduler/detokenizer processes."""
        import psutil

        if not self.is_alive():
            return None
        try:
            root = psutil.Process(self._process.pid)
            return sum(p.memory_info().rss for p in [root] + root.children(recursive=True))
        except psutil.Error:
            return None

    def device_memory_bytes(self) -> int | None:
        """Memory in use on the engine's GPU (the most of its GPUs with tp_size > 1), device-wide,
        or None without a GPU.

        Device-wide (NVML `nvmlDeviceGetMemoryInfo(...).used`), not the server's processes' share:
        inside a container NVML's per-process list (`nvmlDeviceGetComputeRunningProcesses`) carries
        the host's PIDs, which never match the server's, so a per-process sum read 0. On a colocated
        GPU the figure includes the sleeping trainer's few bytes (reported on their own as
        memory_trainer_asleep_bytes) and both CUDA contexts; what changes across a release is the
        engine's."""
        if not self.backend.has_gpu or not self.is_alive():
            return None
        import pynvml

        try:
            pynvml.nvmlInit()
            try:
                keys = nvml_device_keys(os.environ.get("CUDA_VISIBLE_DEVICES"), pynvml.nvmlDeviceGetCount())
                handles = [pynvml.nvmlDeviceGetHandleByUUID(key) if isinstance(key, str)
                           else pynvml.nvmlDeviceGetHandleByIndex(key) for key in keys]
                return max(int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) for handle in handles)
            finally:
                pynvml.nvmlShutdown()
        except (pynvml.NVMLError, ValueError):
            return None

    def log_tail(self, lines: int = 30) -> str:
        return read_log_tail(self.log_path, lines) or "(no log)"

    def _log_lines(self) -> list[str]:
        """The lines this launch wrote to the log (it is appended to across restarts)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace").splitlines()
        except OSError:
            return []

    def _cpu_layer_refusal(self) -> str | None:
        """Why the CPU layer refused this SGLang, if it did: a refusal in the scheduler process is
        followed by the server's own traceback, longer than the log tail."""
        refusals = [line[len(REFUSAL_MARK):] for line in self._log_lines() if line.startswith(REFUSAL_MARK)]
        return refusals[-1] if refusals else None

    def _shared_memory_files(self) -> set[str]:
        """/dev/shm files mapped by the server's process tree (SGLang's own segments)."""
        import psutil

        try:
            root = psutil.Process(self._process.pid)
            processes = [root] + root.children(recursive=True)
        except psutil.Error:
            return set()
        return {path for process in processes for path in _mapped_files(process.pid)
                if path.startswith(_SGLANG_SHM_PREFIXES)}

    def _freeze_gc(self) -> None:
        """Without it, full collections over the server's start-up objects pause it for ~0.5 s
        every few seconds under load (SGLangClient.freeze_gc). Only a speed-up: a server that
        refuses it (e.g. one started with an admin key in rollout.engine.extra_args) still serves,
        and the refusal goes to its log."""
        try:
            self.client.freeze_gc()
        except EngineError as error:
            self._note(f"/freeze_gc was refused ({error.reason}); its garbage collector is not frozen")

    def _note(self, text: str) -> None:
        try:
            with open(self.log_path, "a") as log:
                log.write(f"\nrlsys: {text}\n")
        except OSError:
            pass

    def kill(self, reason: str) -> None:
        """Stop the server at once (it does not answer); the reason goes to its log."""
        self._note(f"stopping this server: {reason}")
        if self._process is not None and self._process.poll() is None:
            # The server alone (SIGKILL ends a stopped process too): its scheduler and detokenizer
            # die with it, and its resource tracker survives to unlink their semaphores; `stop`
            # then waits for the group and removes the rest.
            self._process.kill()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server and every process it started (they share its session).

        SGLang tears its children down with SIGKILL, which skips their unlink paths, so the
        shared-memory segments they mapped are removed here once they are all gone.
        """
        if self._process is None:
            return
        owned_shm = self._owned_shm | (self._shared_memory_files() if self._process.poll() is None else set())
        if self._process.poll() is None:
            # SIGTERM to the server alone: it tears down its scheduler and detokenizer itself.
            self._process.terminate()
            try:
                self._process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # SGLang's multiprocessing resource tracker (same group) unlinks the server's semaphores
        # once the server is gone; killing it before it has done so leaves /dev/shm/sem.mp-* behind.
        _wait_for_group_exit(self._process.pid, grace_s=5.0)
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # stragglers in the group
        except ProcessLookupError:
            pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._process = None
        for path in owned_shm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

"""Helpers shared by the tests: paths, run commands, configs, leftovers checks, a reward service."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trainer_spec(model_dir: Path, *, dtype: str = "float32", lora=None, **fields):
    """A TrainerSpec for `model_dir` (compute `dtype`, LoRA settings `lora` as a dict); each keyword
    goes to the config section that has the field (trainer: lr, packing, ...; algorithm:
    use_kl_loss, clip_eps_low, ...)."""
    from rlsys.actors.trainer import TrainerSpec
    from rlsys.algorithms.policy_losses import POLICY_LOSSES
    from rlsys.config import AlgorithmConfig, ModelConfig, TrainerConfig

    trainer = {k: v for k, v in fields.items() if k in TrainerConfig.model_fields}
    # and a policy loss's flat keys of earlier versions (cispo_max_ratio), which the section still reads
    algorithm = {k: v for k, v in fields.items()
                 if k in AlgorithmConfig.model_fields or k.split("_", 1)[0] in POLICY_LOSSES}
    unknown = fields.keys() - trainer.keys() - algorithm.keys()
    if unknown:
        raise TypeError(f"no trainer or algorithm field named {sorted(unknown)}")
    return TrainerSpec(ModelConfig(path=str(model_dir), dtype=dtype, lora=lora), TrainerConfig(**trainer),
                       AlgorithmConfig(**algorithm))


def meeting_queue():
    """What ranks a test spawns meet through (`meet`): create it in the test, pass it to each rank."""
    import multiprocessing

    return multiprocessing.get_context("spawn").SimpleQueue()


def meet(rank: int, world: int, queue, reserve) -> tuple[str, int]:
    """Where a group of spawned ranks meets, as a run's ranks do (actors/group.py): rank 0 reserves
    the port (`reserve()` -> (address, port), held until its store serves it, so no other process
    can take it in between) and tells the others through `queue` (`meeting_queue`)."""
    if rank == 0:
        address, port = reserve()
        for _ in range(world - 1):
            queue.put((address, port))
        return address, port
    return queue.get()


def join_gloo_group(rank: int, world: int, queue) -> None:
    """The default gloo group of spawned ranks, met through `meet` (rlsys/system/rendezvous.py)."""
    from datetime import timedelta

    import torch.distributed as dist

    from rlsys.system.rendezvous import ReservedPort, rank_store

    reserved = ReservedPort("127.0.0.1") if rank == 0 else None
    address, port = meet(rank, world, queue, lambda: ("127.0.0.1", reserved.port))
    store = rank_store(rank, address, port, world, timedelta(minutes=5), reserved)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def ports_outside_the_ephemeral_range(count: int) -> list[int]:
    """`count` distinct ports, free now, for a program that binds them itself later (`ray start`'s):
    drawn below the kernel's ephemeral range, which every outgoing connection takes its local port
    from (a port from bind(0) lies in it and can be taken by any connection before the program binds
    it), and above Ray's worker ports (10002-19999)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = random.Random().sample(range(20000, low), min(low - 20000, 50 * count))
    ports = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"not {count} free ports in 20000-{low - 1}")


def random_sequences(seed: int, count: int, prompt_lens: tuple[int, int] = (2, 9),
                     response_lens: tuple[int, int] = (1, 12), vocab: int = 80) -> list:
    """`count` TrainSequences of random tokens (ids 3..vocab-1), lengths drawn from the inclusive
    ranges, advantages uniform in [-1.5, 1.5]; the same for the same seed."""
    import random

    from rlsys.records import TrainSequence

    rng = random.Random(seed)
    sequences = []
    for _ in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(*response_lens))]
        sequences.append(TrainSequence(prompt + response, len(prompt), advantage=rng.uniform(-1.5, 1.5)))
    return sequences


def train_command(config: str, model_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`rlsys train` of a config in configs/ on the tiny model, quietly, on a free status port."""
    return [sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs" / config),
            f"model.path={model_dir}", f"run_dir={run_dir}", "logging.progress_bar=false",
            "status.port=0", *overrides]


@contextmanager
def served_run_dir(run_dir: Path):
    """`rlsys serve RUN_DIR` on a port it picks itself (--port 0: none chosen here can be taken before
    it binds), answering; yields its URL, read from its "serving ... at URL/" line."""
    import re
    import subprocess
    import time
    import urllib.request

    server = subprocess.Popen([sys.executable, "-m", "rlsys.cli", "serve", str(run_dir), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        while not (found := re.search(r" at (http://\S+?)/?$", said.strip())):
            said = server.stdout.readline()
            assert said, f"rlsys serve ended without saying where it serves (exit {server.wait()})"
        url = found.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "rlsys serve did not answer"
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextmanager
def standing_rollout(name: str, log_dir: Path):
    """The engines of the session's standing set `name` (tests/conftest.py `standing_set`) behind a
    RolloutManager, leased to the test as a run leases them, each engine first given the model's own
    weights at version 0 from disk: a test starts from the checkpoint whatever the last user of the
    set left. On exit an engine the test killed is started again in its slot (a start charged to the
    test that killed it), the engines are left ready (nothing in flight, no weight-update session
    open) and the lease is released; they keep running for the next test."""
    import ray

    from rlsys.rollout.manager import RolloutManager
    from rlsys.rollout.standing import Lease, engine_handle, service
    from rlsys.run.attach import revive_dead_engines

    record = ray.get(service(name).record.remote())
    lease = Lease.take(name, "test", str(log_dir))
    rollout = RolloutManager.start(record.spec, record.topology.num_engines, str(log_dir), [], standing=record)
    try:
        rollout.fleet.wait_ready()
        ray.get([engine.make_ready.remote() for engine in rollout.fleet.engines])
        ray.get([engine.load_weights_from_disk.remote(record.model_path, 0) for engine in rollout.fleet.engines])
        yield rollout
    finally:
        if revive_dead_engines(record):
            rollout.fleet.engines = [engine_handle(record, index) for index in range(len(rollout.fleet.engines))]
        rollout.shutdown()
        lease.release()


def set_engine(name: str = "quickstart", index: int = 0) -> dict:
    """Engine `index` of the session's standing set `name`: its health (url, alive, ...) and weight version."""
    import ray

    from rlsys.rollout.standing import engine_handle, service

    record = ray.get(service(name).record.remote())
    engine = engine_handle(record, index)
    return {**ray.get(engine.health.remote()), "weight_version": ray.get(engine.weight_version.remote())}


def server_listening_on(url: str):
    """The SGLang server process that listens at `url`."""
    import psutil

    port = url.rsplit(":", 1)[1]
    servers = [p for p in psutil.process_iter(["cmdline"])
               if "sglang.launch_server" in " ".join(p.info["cmdline"] or [])
               and f"--port {port}" in " ".join(p.info["cmdline"] or [])]
    assert len(servers) == 1, servers
    return servers[0]


@contextmanager
def started_run(config: str, model_dir: Path, run_dir: Path, *overrides: str, own_process_group: bool = False):
    """`rlsys train` running in the background (stdout/stderr piped); killed if still running at the end.
    `own_process_group`: the run leads a process group, as a command in a terminal's foreground does."""
    import subprocess

    run = subprocess.Popen(train_command(config, model_dir, run_dir, *overrides), cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           process_group=0 if own_process_group else None)
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


# Shared-memory files a run makes: torch's, SGLang's and multiprocessing's semaphores.


RUN_SHM_PREFIXES = ("torch_", "sglang_", "sgl_shm", "sem.mp-")
# How long a leftover file must stay unowned (a resource tracker unlinks a dead process's semaphore within it).
SHM_SETTLE_S = 1.0


# The environment variable that marks the processes a leftovers check watches (see Leftovers).
LEFTOVERS_MARK = "RLSYS_TEST_LEFTOVERS"

# Marks every process a pytest session starts (inherited through its Ray clusters and SGLang servers,
# daemonized ones too): `make test` runs sessions side by side, and each counts and checks only its own.
SESSION_MARK = "RLSYS_TEST_SESSION"


class Leftovers:
    """What a run leaves behind: new SGLang/Ray processes outside this pytest's own tree, and new
    shared-memory files of torch, SGLang or multiprocessing. Snapshot before, check after.

    Only the test's own count: the `leftovers` fixture puts `mark` in this process's environment
    (LEFTOVERS_MARK) for the test, so every process the test starts inherits it, through a local
    Ray cluster's raylet and an engine's SGLang server too. Ray's agents get an environment of their
    own: they count while their parent is marked, and once orphaned (whoever left them). A live
    process of anyone else on the machine (a developer's own run, another pytest), and the files it
    made or holds, are neither reported nor returned by `new_pids` to be killed."""

    def __init__(self, mark: str):
        import psutil

        self.mark = mark
        self._pids = {p.pid for p in psutil.process_iter()}
        self._shm = set(os.listdir("/dev/shm"))

    def processes(self) -> list[str]:
        import psutil

        mine = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.pid in self._pids or proc.pid in mine:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if ("sglang" in cmdline or "ray::" in cmdline or "raylet" in cmdline or "gcs_server" in cmdline) \
                    and self._is_the_tests(proc) and proc.is_running():  # one gone meanwhile is not left
                found.append(f"{proc.pid}: {cmdline[:120]}")
        return found

    def shm_files(self) -> list[str]:
        """New run files whose creator or holder is the test's or gone, seen so twice `SHM_SETTLE_S`
        apart: a semaphore another pytest session's process just created or released (its resource
        tracker unlinks it a moment later) is not a leftover, and a leftover stays."""
        found = self._unowned_shm_files()
        if found:
            time.sleep(SHM_SETTLE_S)
            again = set(self._unowned_shm_files())
            found = [name for name in found if name in again]
        return found

    def _unowned_shm_files(self) -> list[str]:
        from rlsys.system.shm_sweep import creator_pid, holders

        new = sorted(n for n in set(os.listdir("/dev/shm")) - self._shm if n.startswith(RUN_SHM_PREFIXES))
        held = holders() if any(creator_pid(n) is None for n in new) else {}
        found = []
        for name in new:
            pid = creator_pid(name)
            owners = [pid] if pid is not None else held.get(f"/dev/shm/{name}", set())
            if not any(self._someone_elses(owner) for owner in owners):
                found.append(name)
        return [name for name in found if os.path.exists(f"/dev/shm/{name}")]

    def new_pids(self, substring: str) -> list:
        """The test's new processes whose command line contains `substring` (e.g. to kill one)."""
        import psutil

        return [p for p in psutil.process_iter(["pid", "cmdline"])
                if substring in " ".join(p.info["cmdline"] or []) and p.pid not in self._pids
                and _mark_of(p) == self.mark]

    def _is_the_tests(self, proc) -> bool:
        """Marked by this test; or unmarked, not another pytest session's (SESSION_MARK: a node that
        session's test daemonized is an orphan too), and orphaned or a child of a marked process."""
        import psutil

        mark = _mark_of(proc)
        if mark is not None:
            return mark == self.mark
        if _mark_of(proc, SESSION_MARK) not in (None, os.environ.get(SESSION_MARK)):
            return False
        try:
            parent = proc.ppid()
            return parent == 1 or _mark_of(psutil.Process(parent)) == self.mark
        except psutil.Error:
            return True  # gone meanwhile: it was new, so it counts (its files are what it left)

    def _someone_elses(self, pid: int) -> bool:
        """A live process of someone else's (a dead one's files count: they are what is left)."""
        import psutil

        try:
            return not self._is_the_tests(psutil.Process(pid))
        except psutil.Error:
            return False


def _mark_of(proc, name: str = LEFTOVERS_MARK) -> str | None:
    """The process's mark `name`, or None (unset, or its environment cannot be read)."""
    import psutil

    try:
        return proc.environ().get(name)
    except psutil.Error:
        return None


# Metrics that time a step, not what it computed: they differ between two runs of the same steps.
TIMING_METRICS = frozenset({"timestamp", "tokens_per_s", "sync_gbps"})


def differing_metrics(rows: list[dict], expected: list[dict], ignore: frozenset[str] = frozenset()) -> list[tuple]:
    """(step, metric, got, expected) wherever two runs' metric rows differ, timing aside (a name in
    TIMING_METRICS or ending in _s) and `ignore`d metrics aside: [] when they computed the same."""
    differing = [(None, "steps", [r["step"] for r in rows], [r["step"] for r in expected])] \
        if [r["step"] for r in rows] != [r["step"] for r in expected] else []
    for got, want in zip(rows, expected, strict=False):
        for name in sorted(set(got) | set(want)):
            if name in TIMING_METRICS or name.endswith("_s") or name in ignore:
                continue
            if got.get(name) != want.get(name):
                differing.append((got["step"], name, got.get(name), want.get(name)))
    return differing


def write_config(path: Path, model_dir: Path, **sections) -> Path:
    """A small valid config file; keyword arguments replace whole sections."""
    import yaml

    tree = {
        "model": {"path": str(model_dir)},
        "data": {"synthetic": {"task": "max_digit", "num_train": 200, "num_eval": 20}},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 2,
                    "engine": {"skip_tokenizer_init": True, "context_length": 64}},
        "trainer": {"num_ranks": 2, "total_steps": 2},
    }
    tree.update(sections)
    path.write_text(yaml.safe_dump(tree))
    return path


class RewardService:
    """A reward service (reward.url) on a free local port, in a thread: scores 1.0 when
    response == label. `fail_next` requests get HTTP 503; `hang_s` delays every
    answer; `mode` switches to protocol errors."""

    def __init__(self):
        self.requests: list[list[dict]] = []
        self.fail_next = 0
        self.hang_s = 0.0
        self.mode = "ok"
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
                service.requests.append(items)
                if service.fail_next > 0:
                    service.fail_next -= 1
                    return self._answer(503, {"detail": "warming up"})
                time.sleep(service.hang_s)
                if service.mode == "short":
                    return self._answer(200, {"scores": [1.0]})
                if service.mode == "bad_request":
                    return self._answer(422, {"detail": "items[0].label missing"})
                scores = [None if item["label"] == "?" else {"error": "cannot grade"} if item["label"] == "!"
                          else float(item["response"] == item["label"]) for item in items]
                self._answer(200, {"scores": scores})

            def _answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda request, address: None  # a client that timed out closed its socket
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def refused_by_cli(*args: str, new_process: bool = False) -> str:
    """`rlsys ARGS` run by the CLI's own `main` in this process, whose modules are imported already (a
    refusal found after the model checks takes ~0.5 s here, 5-10 s as a new process); check that it
    ended as a user error (2) with one `rlsys: error:` message and no traceback, and return what it
    wrote to stderr. `new_process`: as `python -m rlsys.cli`, for a test that sets environment
    variables a library reads when imported (huggingface_hub's cache and offline switches); that
    also checks the process's exit status."""
    import contextlib
    import io
    import subprocess

    from rlsys.cli import main

    if new_process:
        result = subprocess.run([sys.executable, "-m", "rlsys.cli", *args], capture_output=True, text=True, timeout=300)
        code, out, err = result.returncode, result.stdout, result.stderr
    else:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(list(args))
        out, err = stdout.getvalue(), stderr.getvalue()
    assert code == 2, (code, out, err)
    assert err.count("rlsys: error: ") == 1 and "Traceback" not in err, err
    return err


def fill_disk(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte with one file; returns it."""
    import errno

    filler = directory / "filler"
    with filler.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
    return filler


def fill_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = "1a2b3c4d" * 5,
                   branch: str = "main") -> Path:
    """Put the checkpoint in `model_dir` into a Hugging Face hub cache directory in the cache's own
    layout (what `hf download` leaves: content-addressed blobs, the commit's snapshot as symlinks
    to them, refs/<branch> naming the commit); returns the snapshot directory."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for source in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / source.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


def check_tracking(run_dir: Path, rows: list[dict]) -> None:
    """A run with logging.backends=[tensorboard,wandb,mlflow]: TensorBoard and MLflow got every step's
    metrics under metrics.jsonl's names, the values of the steps that ran again after a recovery
    replacing their first ones; wandb ran offline."""
    import pytest
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [r["step"] for r in rows]
    assert [e.value for e in events.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in rows])
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens file stores only when asked
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rlsys").experiment_id])
    # A step run again after a recovery has two points in MLflow (it cannot delete one): the later counts.
    history = client.get_metric_history(run.info.run_id, "eval_reward_mean")
    evals = {m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))}
    assert sorted(evals.items()) == [(r["step"], r["eval_reward_mean"]) for r in rows
                                     if r.get("eval_reward_mean") is not None]
    assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def image_sensitive_vlm(directory: Path, arch: str = "qwen2_5_vl") -> Path:
    """The tiny Qwen2.5-VL (`rlsys make-tiny-model --arch qwen2_5_vl`; or Qwen3-VL, `arch`) with its
    mergers' output 4x larger. At random init the model's answers hardly depend on the image (two
    images move a log-prob by ~1e-5), which would let a wrong or stale image feature pass a
    comparison of log-probs; here two images move it by ~0.08."""
    from safetensors.torch import load_file, save_file

    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(directory, TinyModelSpec(arch=arch))
    weights = load_file(model / "model.safetensors")
    outputs = ("visual.merger.mlp.2.", "model.visual.merger.linear_fc2.", "model.visual.deepstack_merger_list.0.linear_fc2.")
    for name in [name for name in weights if name.startswith(outputs)]:
        weights[name] = weights[name] * 4
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def png_bytes(color=(255, 0, 0), size=(32, 32)) -> bytes:
    """A PNG of one colour, as a dataset row or an engine request carries an image."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()

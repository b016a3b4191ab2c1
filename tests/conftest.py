"""Shared fixtures: a tiny local model, and one Ray cluster reused by the integration tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers import SESSION_MARK
from tests.start_ledger import SHARED_START_BUDGET, START_LEDGER, over_budget, record_starts


@pytest.fixture(autouse=True)
def rlsys_console_output():
    """What the CLI sets up (rlsys.observability.logs), for tests calling rlsys in-process: the
    "rlsys: ..." lines on stdout (warnings, errors on stderr), where capsys reads them."""
    from rlsys.observability.logs import configure_logging

    configure_logging()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlsys.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """A local Ray cluster for the tests that drive actors, and for `rlsys train` runs that join it
    (`ray_address`); shut down (with its workers) at the end. Yields its address. Its logical CPUs
    are more than any one test's placement asks for (a run's actors and a test's own at once)."""
    import ray

    from rlsys.system.cluster import ACTOR_ENV
    from tests.helpers import ports_outside_the_ephemeral_range

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The cluster's processes, a submitted job's `python` among them, run this environment's Python
    # (as a real node's image would have it first on its PATH).
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    # Logical CPUs: the standing engine sets hold their placement bundles while they stand (a colocated
    # set of 2 ranks holds 4), beside the runs and trainer groups the tests start. Its dashboard is
    # the job server `ray job submit` talks to (`ray_dashboard`), on a port no connection holds.
    context = ray.init(address="local", num_cpus=64, include_dashboard=True, dashboard_host="127.0.0.1",
                       dashboard_port=ports_outside_the_ephemeral_range(1)[0], log_to_driver=False,
                       runtime_env={"env_vars": ACTOR_ENV})
    _DASHBOARD["url"] = f"http://{context.dashboard_url}"
    yield ray.get_runtime_context().gcs_address
    _stop_standing_engines()
    ray.shutdown()


@pytest.fixture(scope="session")
def trainer_pool(ray_cluster):
    """Trainer groups kept warm across the session's trainer tests (tests/trainer_pool.py); a fixture
    of a wider scope takes and gives back through it directly, as `warm_trainer_groups` does."""
    from tests.trainer_pool import TrainerPool

    pool = TrainerPool()
    yield pool
    pool.close()


@pytest.fixture
def warm_trainer_groups(trainer_pool, request):
    """`take((spec, num_ranks), ...)`: InspectableTrainerGroups for the test, from `trainer_pool`;
    given back when the test ends, kept warm only if nothing failed meanwhile."""
    taken = []
    failed_before = request.session.testsfailed

    def take(*wanted):
        groups = trainer_pool.take(*wanted)
        taken.extend(groups)
        return groups

    yield take
    trainer_pool.give_back(taken, healthy=request.session.testsfailed == failed_before)


# The session cluster's dashboard URL, once it is up.
_DASHBOARD: dict[str, str] = {}


@pytest.fixture(scope="session")
def ray_dashboard(ray_cluster) -> str:
    """The session cluster's dashboard (its job server): the --address of `ray job submit`."""
    return _DASHBOARD["url"]


# Standing engine sets of the session (rlsys engines up), by name: started the first time a test asks.
_STANDING: dict[str, str] = {}


def _stop_standing_engines() -> None:
    if _STANDING:
        from rlsys.engines.standing_set import engines_down

        engines_down(None, force=True)
        _STANDING.clear()


def standing_set(name: str, config: str, overrides: list[str], log_dir: Path) -> str:
    """`rollout.attach=NAME`, after starting standing set NAME from configs/CONFIG + overrides on the
    session cluster if this session has not yet (tests of one identity share its engines)."""
    if name not in _STANDING:
        from rlsys.config import load_config
        from rlsys.engines.standing_set import engines_up
        from tests.helpers import REPO

        engines_up(load_config(REPO / "configs" / config, overrides), name, log_dir / name)
        _STANDING[name] = config
    return f"rollout.attach={name}"


def stop_standing_set(name: str) -> None:
    """Stop standing set NAME when the tests of its identity are done (a set used by one module only
    need not hold its memory for the rest of the session)."""
    if _STANDING.pop(name, None) is not None:
        from rlsys.engines.standing_set import engines_down

        engines_down(name, force=True)


@pytest.fixture(scope="session")
def quickstart_engines(ray_cluster, tiny_model_dir, tmp_path_factory) -> str:
    """Standing engines for configs/quickstart.yaml on the tiny model (colocated, 2 trainer ranks,
    1 engine): the override that attaches a run to them (with `ray_address`). For tests whose
    subject is not engine start-up, death or cleanup."""
    return standing_set("quickstart", "quickstart.yaml", [f"model.path={tiny_model_dir}"],
                        tmp_path_factory.getbasetemp() / "standing-engines")


@pytest.fixture(scope="session")
def disaggregated_engines(ray_cluster, tiny_model_dir, tmp_path_factory) -> str:
    """Standing engines for configs/quickstart_disaggregated.yaml with one trainer rank and one
    engine, on the tiny model, with a context of DISAGGREGATED_CONTEXT tokens (room for long answers):
    the override that attaches a run to them (a run also sets rollout.engine.context_length to it)."""
    return standing_set("disaggregated", "quickstart_disaggregated.yaml",
                        [f"model.path={tiny_model_dir}", "trainer.num_ranks=1", "rollout.num_engines=1",
                         f"rollout.engine.context_length={DISAGGREGATED_CONTEXT}"],
                        tmp_path_factory.getbasetemp() / "standing-engines")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a chat template (rlsys make-tiny-model --chat): Qwen's turn markers, <|im_end|> as EOS."""
    from rlsys.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-chat-model"), chat=True)


@pytest.fixture(scope="session")
def chat_engines(ray_cluster, tiny_chat_model_dir, tmp_path_factory) -> str:
    """Standing engines for configs/examples/verifiers_digits.yaml on the tiny chat model (colocated, 2
    trainer ranks, 1 engine): chat-message tasks (a verifiers environment's); the override that attaches."""
    return standing_set("chat", "examples/verifiers_digits.yaml", [f"model.path={tiny_chat_model_dir}"],
                        tmp_path_factory.getbasetemp() / "standing-engines")


# The disaggregated set's context: the long-tailed copy task's (bench/long_tail.py), whose runs share it.
DISAGGREGATED_CONTEXT = 320


@pytest.fixture(scope="session")
def bf16_engines(ray_cluster, tiny_model_dir, tmp_path_factory) -> str:
    """Standing engines for configs/quickstart.yaml whose SGLang computes in bf16
    (rollout.engine.extra_args) while the model and trainers are fp32: a behaviour policy that
    differs from the trainer's by bf16 rounding. For bf16 weight sync and the corrections of a
    mismatched engine; the override that attaches a run to them."""
    return standing_set("bf16", "quickstart.yaml",
                        [f"model.path={tiny_model_dir}", "rollout.engine.extra_args=[--dtype, bfloat16]"],
                        tmp_path_factory.getbasetemp() / "standing-engines")




class _StartCounter:
    """Counts the SGLang servers and Ray clusters (GCS servers) the session starts, by watching the
    machine's processes (each lives for seconds at least: polled every 0.25 s). A process marked by
    another session (SESSION_MARK) is that session's; an unmarked one (its environment unreadable,
    or started with an environment of its own) is counted here, so nothing the session starts is missed."""

    def __init__(self):
        import threading
        import uuid

        self.mark = os.environ[SESSION_MARK] = uuid.uuid4().hex

        self.seen: dict[str, set] = {"sglang": set(), "ray": set()}
        self.test = "(session start)"  # the test running now (pytest_runtest_setup), whom a start is charged to
        self.own_engines: set[str] = set()  # tests marked own_engines (not charged to the shared budget)
        self.by_test: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="start-counter")
        self._thread.start()

    def _watch(self) -> None:
        """Each poll lists the machine's pids and reads the command line of the new ones only:
        reading every process's each time cost ~6% of a core for the whole session."""
        import time

        import psutil

        kinds: dict[int, str | None] = {}  # pid -> "sglang", "ray" or None, for the processes alive at the last poll
        while not self._stop.wait(0.25):
            pids = set(psutil.pids())
            for pid in sorted(pids - kinds.keys()):  # parents (lower pids, mostly) before their children
                try:
                    process = psutil.Process(pid)
                    command, ppid, key = " ".join(process.cmdline()), process.ppid(), (pid, process.create_time())
                except psutil.Error:  # gone already
                    continue
                if time.time() - key[1] < 1.0 and "sglang.launch_server" not in command \
                        and "gcs_server" not in command:
                    continue  # young: it may not have exec'd its program yet (a fork has its parent's command line)
                kinds[pid] = None
                if self._another_sessions(process):
                    continue
                if "sglang.launch_server" in command:
                    kinds[pid] = "sglang"
                    # a server's scheduler and detokenizer, forked, carry its command line too
                    if kinds.get(ppid) != "sglang":
                        self._saw("sglang", key)
                elif command.split(" ", 1)[0].endswith("gcs_server"):
                    kinds[pid] = "ray"
                    self._saw("ray", key)
            for pid in kinds.keys() - pids:
                del kinds[pid]

    def _another_sessions(self, process) -> bool:
        import psutil

        try:
            return process.environ().get(SESSION_MARK, self.mark) != self.mark
        except psutil.Error:
            return False

    def _saw(self, kind: str, key: tuple) -> None:
        if key not in self.seen[kind]:
            self.seen[kind].add(key)
            counts = self.by_test.setdefault(self.test, {"sglang": 0, "ray": 0})
            counts[kind] += 1

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {kind: len(keys) for kind, keys in self.seen.items()}


def _machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, summed over its cores (/proc/stat): a test's
    own processes, its Ray workers and SGLang servers alike (all but idle and iowait)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """How many of the machine's cores each test kept busy (setup, call and teardown), appended to a
    JSON-lines file as each test ends (RLSYS_CPU_REPORT; an interrupted suite keeps what it measured):
    the suite's idle time is what running tests side by side could use."""

    def __init__(self, path: Path):
        self.path = path
        self.cores = os.cpu_count() or 1
        self.totals = {"wall_s": 0.0, "busy_core_s": 0.0}

    def record(self, nodeid: str, wall: float, busy: float) -> None:
        import json

        self.totals["wall_s"] += wall
        self.totals["busy_core_s"] += busy
        with self.path.open("a") as report:
            report.write(json.dumps({"test": nodeid, "wall_s": round(wall, 2), "busy_core_s": round(busy, 2),
                                     "cores_busy": round(busy / wall, 2) if wall else 0.0, "cores": self.cores}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time

    meter = getattr(item.config, "_rlsys_cpu", None)
    start, busy = time.monotonic(), _machine_busy_seconds()
    yield
    if meter is not None:
        meter.record(item.nodeid, time.monotonic() - start, _machine_busy_seconds() - busy)


def pytest_sessionstart(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # pytest-xdist (make test-fast's unit tests): the controller's counter watches the machine
    session.config._rlsys_starts = _StartCounter()
    if os.environ.get("RLSYS_CPU_REPORT"):
        session.config._rlsys_cpu = _CpuMeter(Path(os.environ["RLSYS_CPU_REPORT"]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    counter = getattr(item.config, "_rlsys_starts", None)
    if counter is not None:  # before the test's fixtures: a session set's starts go to its first user
        counter.test = item.nodeid
        if item.get_closest_marker("own_engines") is not None:
            counter.own_engines.add(item.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """What the suite started, and which test started it (its budget: SHARED_START_BUDGET)."""
    meter = getattr(config, "_rlsys_cpu", None)
    if meter is not None and meter.totals["wall_s"]:
        terminalreporter.write_line(
            f"rlsys cpu: the tests kept {meter.totals['busy_core_s'] / meter.totals['wall_s']:.2f} of "
            f"{meter.cores} cores busy on average over {meter.totals['wall_s']:.0f} s (per test: {meter.path})")
    counter = getattr(config, "_rlsys_starts", None)
    if counter is None:
        return
    counts = counter.stop()
    shared = 0
    for test, started in sorted(counter.by_test.items(), key=lambda item: (-item[1]["sglang"], -item[1]["ray"])):
        own = test in counter.own_engines
        shared += 0 if own else started["sglang"]
        terminalreporter.write_line(f"rlsys starts: {started['sglang']} SGLang, {started['ray']} Ray: {test}"
                                    + (" (own_engines)" if own else ""))
    terminalreporter.write_line(
        f"rlsys: this session started {counts['sglang']} SGLang server(s) and {counts['ray']} Ray cluster(s); "
        f"{shared} SGLang start(s) outside the own_engines tests (budget {SHARED_START_BUDGET})")
    ledger = os.environ.get(START_LEDGER)
    if ledger:  # make test's sessions: the budget is the suite's, summed at its end (tests/start_ledger.py)
        record_starts(Path(ledger), counts, shared)
    elif shared > SHARED_START_BUDGET:
        terminalreporter.write_line(over_budget(shared), red=True, bold=True)


@pytest.fixture(scope="session")
def ray_address(ray_cluster) -> str:
    """`placement.ray_address=...`: a `rlsys train` run joins the session's cluster, as a job submitted
    to a running cluster does, instead of starting (and stopping) a local one: a one-step run took
    24-25 s joined against 32 s with its own cluster on a 2-core machine. Only for runs whose test
    does not look at what a run leaves behind or kill its driver: a joined run does not wait for
    its workers to exit, so those keep a cluster of their own, as a local run has."""
    return f"placement.ray_address={ray_cluster}"


@pytest.fixture
def leftovers(monkeypatch):
    """A Leftovers check (tests/helpers.py) started now: after the session's fixtures (a function
    fixture comes after them), with its mark in the environment of everything the test starts."""
    import uuid

    from tests.helpers import LEFTOVERS_MARK, Leftovers

    mark = uuid.uuid4().hex
    monkeypatch.setenv(LEFTOVERS_MARK, mark)
    return Leftovers(mark)


# The session's engine sets, by the fixture that stands each up: the set's name (`standing_set`). A test
# that asks for one shares its engines with every test of its identity.
ENGINE_SETS = {"quickstart_engines": "quickstart", "disaggregated_engines": "disaggregated", "bf16_engines": "bf16",
               "chat_engines": "chat"}


class _EngineSetLives:
    """Runs the users of each engine set but the quickstart one (whose users fill the session) one
    after another, and stops the set after its last user: an idle set still costs ~4% of a core (its
    SGLang scheduler, server and Ray actors), ~120 core-seconds over a session for a set whose users
    sat in its first and last test files."""

    def __init__(self):
        self.last_user: dict[str, str] = {}  # nodeid -> the set its test is the last user of

    @pytest.hookimpl(trylast=True)  # after `-m` deselected: the tests that run
    def pytest_collection_modifyitems(self, items):
        def set_of(item):
            return next((ENGINE_SETS[name] for name in ENGINE_SETS
                         if name in item.fixturenames and name != "quickstart_engines"), None)

        ordered, placed = [], set()
        for item in items:
            name = set_of(item)
            if name is None:
                ordered.append(item)
            elif name not in placed:  # all of the set's users, where its first one was
                placed.add(name)
                ordered += [other for other in items if set_of(other) == name]
        items[:] = ordered
        self.last_user = {item.nodeid: name for item in items if (name := set_of(item)) is not None}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield
        name = self.last_user.get(item.nodeid)
        if name is not None and (nextitem is None or self.last_user.get(nextitem.nodeid) != name):
            stop_standing_set(name)


def pytest_configure(config):
    config.pluginmanager.register(_EngineSetLives(), "rlsys-engine-set-lives")


def _check_second_stream(item) -> None:
    """`second_stream` tests run in make test's second stream, on a Ray cluster of that session's own
    where none of the shared engine sets stands: such a test must use the session cluster and no set."""
    if item.get_closest_marker("second_stream") is None:
        return
    sets = sorted(ENGINE_SETS.keys() & set(item.fixturenames))
    if sets or "ray_cluster" not in item.fixturenames or item.get_closest_marker("own_engines") is not None:
        why = f"uses {', '.join(sets)}" if sets else (
            "starts engines of its own (own_engines)" if "ray_cluster" in item.fixturenames else
            "does not use the session's Ray cluster")
        raise pytest.UsageError(f"{item.nodeid} is marked second_stream but {why}: second_stream is for tests on "
                                "the session cluster that use none of its shared engine sets")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config, items):
    """Tests filed by cost (docs/design.md): every test in tests/e2e is `slow` (it starts Ray, SGLang,
    an `rlsys train` run, a browser or network namespaces), and a test in tests/unit that is marked
    `slow` or asks for the session's Ray cluster is refused: it belongs in tests/e2e. `gpu`-marked
    tests run only where CUDA is available (they are skipped on the CPU machines)."""
    import torch

    tests = Path(__file__).parent
    ray_fixtures = {"ray_cluster", "ray_address", *ENGINE_SETS}
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(tests / "e2e"):
            item.add_marker(pytest.mark.slow)
            # every engine set and trainer group of the session stands on its cluster (fixture closure)
            if "ray_cluster" in item.fixturenames:
                item.add_marker(pytest.mark.shared_cluster)
            _check_second_stream(item)
        elif path.is_relative_to(tests / "unit"):
            uses = sorted(ray_fixtures.intersection(item.fixturenames))
            if item.get_closest_marker("slow") is not None or uses:
                why = f"uses {', '.join(uses)}" if uses else "is marked slow"
                raise pytest.UsageError(f"{item.nodeid} {why}: it belongs in tests/e2e, not tests/unit "
                                        "(tests filed by cost: docs/design.md)")

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs mounted at tmp_path/"disk" (a disk that fills up), unmounted at the end; needs
    root, as the machines that run the tests give."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)

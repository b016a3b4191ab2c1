"""Where every process of a run is: the Python stacks of the driver, each trainer rank and each
engine's server tree (its scheduler and detokenizer are the server's children), read with py-spy
from each process's own node, written to a directory, and summed up in one line that names which
ranks wait inside torch.distributed and which do not (the one that never reached the collective).

py-spy (`py-spy dump --nonblocking`) reads another process's memory without stopping it, so it
also reads a process that is stopped (SIGSTOP) or deadlocked, and it needs nothing from the
process itself; it does need ptrace rights over it (root, or CAP_SYS_PTRACE: containers without
it get "Permission denied"). Where py-spy cannot read a process of rlsys's own (the trainer ranks),
the process is asked instead: each rank registers faulthandler on STACK_SIGNAL at start
(`answer_stack_signal`), which writes every thread's stack to its stderr (Ray's worker-*.err file on
its node, found through /proc/PID/fd/2) from Python's own signal handling; a stopped process cannot
answer, and the dump says so. SGLang's processes register no such handler (the signal's default
action would end them), so only py-spy reads them. Nodes other than the driver's run their part in
a zero-CPU Ray task pinned to the node, as the node checks do.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

PY_SPY_TIMEOUT_S = 30.0
STACK_SIGNAL = signal.SIGUSR2  # neither Ray's workers nor SGLang use it
SIGNAL_ANSWER_S = 5.0  # how long a process gets to write its stacks after STACK_SIGNAL
# A frame in py-spy's dump: "    function (path/to/file.py:123)"
_FRAME = re.compile(r"^\s+(?P<function>\S+) \((?P<file>.+?):(?P<line>\d+)\)")
_THREAD = re.compile(r'^Thread (?P<tid>\S+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?')
# py-spy shortens paths under sys.path ("torch/distributed/distributed_c10d.py", "actors/trainer.py").
_DISTRIBUTED = re.compile(r"(^|/)torch/distributed/")
# rlsys's own code, however it is installed (the repository's top-level packages map under rlsys.)
_OWN_CODE = re.compile(r"(^|/)(rlsys|actors|weight_sync|rollout)/")
_THE_DUMP_ITSELF = ("system/stacks.py", "run/hangs.py")  # the driver's own frames while it dumps


@dataclass(frozen=True)
class ProcessRef:
    """A process to dump: what it is in the run, and where."""

    role: str  # "driver", "trainer rank 1", "engine-0"
    pid: int
    node_id: str
    address: str
    with_children: bool = False  # an engine's SGLang server: its scheduler and detokenizer too
    answers_signal: bool = False  # it registered `answer_stack_signal` (the fallback when py-spy cannot read it)


@dataclass(frozen=True)
class ProcessStacks:
    role: str
    pid: int
    address: str
    name: str  # the process's name (SGLang's children name themselves: sglang::scheduler, ...)
    state: str  # psutil's: running, sleeping, stopped, zombie, ...; "gone"
    stacks: str  # py-spy's dump, or why there is none
    collective: str | None  # the innermost torch.distributed frame, "function (file)"; None: not in one
    where: str | None  # the innermost frame of rlsys's own code

    def describe(self) -> str:
        state = "stopped (SIGSTOP?)" if self.state == "stopped" else self.state
        place = f"inside torch.distributed {self.collective}" if self.collective else "not in a collective"
        at = f", at {self.where}" if self.where else ", outside rlsys's code (idle, or in Ray's)"
        return f"{self.role} (pid {self.pid} on {self.address}, {state}): {place}{at}"


def py_spy() -> str | None:
    """The py-spy executable: beside this Python's (a virtualenv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_on_this_node(refs: list[ProcessRef]) -> list[ProcessStacks]:
    """Each process's (and, with_children, its descendants') stacks, read on this node in parallel."""
    import psutil

    jobs: list[tuple[ProcessRef, int]] = []
    for ref in refs:
        jobs.append((ref, ref.pid))
        if ref.with_children:
            try:
                jobs += [(ref, child.pid) for child in psutil.Process(ref.pid).children(recursive=True)]
            except psutil.Error:
                pass
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(jobs)))) as pool:
        return list(pool.map(lambda job: _dump(*job), jobs))


def _dump(ref: ProcessRef, pid: int) -> ProcessStacks:
    import psutil

    try:
        process = psutil.Process(pid)
        name, state = process.name(), process.status()
    except psutil.Error:
        return ProcessStacks(ref.role, pid, ref.address, "", "gone", "the process no longer exists", None, None)
    role = ref.role if pid == ref.pid else f"{ref.role} {name}"
    stopped = state == psutil.STATUS_STOPPED
    text = own_stacks() if pid == os.getpid() else _py_spy_dump(pid, stopped)
    if text.startswith(PY_SPY_FAILED) and ref.answers_signal and pid == ref.pid:
        answer = None if stopped else signalled_stacks(pid)
        if answer is not None:
            text = f"{answer}\n({text.splitlines()[0]})\n"
        else:
            text += ("\n(it was asked instead: it is stopped and cannot answer)" if stopped
                     else f"\n(it was asked instead and did not answer within {SIGNAL_ANSWER_S:g} s)")
    collective, where = read_frames(text)
    return ProcessStacks(role, pid, ref.address, name, state, text, collective, where)


def _py_spy_dump(pid: int, stopped: bool) -> str:
    """py-spy's dump of `pid`. A running process is paused while it is read (py-spy's default): read
    without pausing, its frames change underneath and the read fails ("Failed to copy PyCodeObject").
    A stopped one is read as it is (attaching would wait on it). One retry in the other mode."""
    executable = py_spy()
    if executable is None:
        return f"{PY_SPY_FAILED}: py-spy is not installed on this node (pip install py-spy)"
    problems = []
    for nonblocking in (stopped, not stopped):
        try:
            done = subprocess.run([executable, "dump", "--pid", str(pid), *(["--nonblocking"] if nonblocking else [])],
                                  capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            problems.append(f"{PY_SPY_FAILED}: it did not answer within {PY_SPY_TIMEOUT_S:g} s")
            continue
        if done.returncode == 0:
            return done.stdout
        problems.append(f"{PY_SPY_FAILED}: {' / '.join((done.stderr or done.stdout).strip().splitlines()[0:4])}")
    return "\n".join(problems)


PY_SPY_FAILED = "py-spy failed"


def answer_stack_signal() -> None:
    """From now on STACK_SIGNAL makes this process write every thread's stack to its stderr
    (faulthandler: from the interpreter's signal handling, also while the main thread is blocked in C)."""
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def signalled_stacks(pid: int) -> str | None:
    """Ask `pid` (which called `answer_stack_signal`) for its stacks and read what it appends to its
    stderr, as py-spy's layout; None when it wrote nothing within SIGNAL_ANSWER_S."""
    try:
        stderr = Path(os.readlink(f"/proc/{pid}/fd/2"))
        start = stderr.stat().st_size
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return None
    deadline = time.monotonic() + SIGNAL_ANSWER_S
    text = ""
    while time.monotonic() < deadline:  # until it has written something and stopped writing
        time.sleep(0.2)
        with open(stderr, errors="replace") as file:
            file.seek(start)
            now = file.read()
        if now and now == text:
            break
        text = now
    return faulthandler_as_py_spy(pid, text) if "File " in text else None


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+)$')


def faulthandler_as_py_spy(pid: int, text: str) -> str:
    """faulthandler's dump rewritten in py-spy's layout (what `read_frames` reads)."""
    lines = [f"Process {pid}: (its own stacks, through {STACK_SIGNAL.name}: py-spy could not read it)", ""]
    for line in text.splitlines():
        if match := _FH_THREAD.match(line):
            lines.append(f"Thread {match[2]} ({'active' if match[1] == 'Current thread' else 'idle'})")
        elif match := _FH_FRAME.match(line):
            lines.append(f"    {match['function']} ({match['file']}:{match['line']})")
    return "\n".join(lines) + "\n"


def own_stacks() -> str:
    """This process's threads, in py-spy's layout (a process cannot pause itself to be read)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = [f"Process {os.getpid()}: {' '.join(sys.argv)[:200]}", ""]
    for ident, frame in sys._current_frames().items():
        lines.append(f'Thread {ident} (active): "{names.get(ident, "")}"')
        for entry in reversed(traceback.extract_stack(frame)):
            lines.append(f"    {entry.name} ({entry.filename}:{entry.lineno})")
    return "\n".join(lines) + "\n"


def read_frames(dump: str) -> tuple[str | None, str | None]:
    """(the innermost torch.distributed frame of any thread, the innermost frame of rlsys's own code
    of the thread that runs it, else of any thread) from py-spy's dump. Frames are listed innermost
    first, thread after thread."""
    threads: list[list[tuple[str, str, str]]] = []
    for line in dump.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (frame := _FRAME.match(line)) and threads:
            threads[-1].append((frame["function"], frame["file"], frame["line"]))
    collective = where = None
    for frames in threads:
        distributed = next((f for f in frames if _DISTRIBUTED.search(f[1])), None)
        own = next((f for f in frames if _OWN_CODE.search(f[1]) and not f[1].endswith(_THE_DUMP_ITSELF)), None)
        if distributed and collective is None:
            collective = f"{distributed[0]} ({Path(distributed[1]).name}:{distributed[2]})"
            where = _place(own) if own else where
        if own and where is None:
            where = _place(own)
    return collective, where


def _place(frame: tuple[str, str, str]) -> str:
    function, file, line = frame
    parts = Path(file).parts
    return f"{function} ({'/'.join(parts[-2:])}:{line})"


def collect_stacks(refs: list[ProcessRef], out_dir: Path, timeout_s: float = 90.0) -> list[ProcessStacks]:
    """Every process's stacks, each node's read on that node; written to `out_dir` (one text file
    per process, and summary.json). A node that does not answer within `timeout_s` is listed as such."""
    from rlsys.system.node import connected_ray

    ray = connected_ray()
    here = ray.get_runtime_context().get_node_id() if ray is not None else None
    by_node: dict[str, list[ProcessRef]] = {}
    for ref in refs:
        by_node.setdefault(ref.node_id, []).append(ref)
    pending = {}
    if ray is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote = ray.remote(num_cpus=0, max_retries=0)(dump_on_this_node)
        pending = {node: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            node_refs) for node, node_refs in by_node.items() if node != here}
    found = dump_on_this_node([ref for node, node_refs in by_node.items() if node not in pending for ref in node_refs])
    for node, call in pending.items():
        try:
            found += ray.get(call, timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 - a lost or hung node: say so, keep the others
            found += [ProcessStacks(ref.role, ref.pid, ref.address, "", "unknown",
                                    f"its node did not answer: {str(error).splitlines()[0][:300]}", None, None)
                      for ref in by_node[node]]
    order = {ref.role: index for index, ref in enumerate(refs)}
    found.sort(key=lambda s: (order.get(s.role, len(order)), s.pid))
    write_stacks(found, out_dir)
    return found


def write_stacks(found: list[ProcessStacks], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stacks in found:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", stacks.role).strip("-")
        (out_dir / f"{slug}-{stacks.pid}.txt").write_text(
            f"# {stacks.describe()}\n# process name: {stacks.name}\n\n{stacks.stacks}")
    summary = [{**asdict(s), "stacks": None, "summary": s.describe()} for s in found]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def summarize(found: list[ProcessStacks], roles_prefix: str = "trainer rank") -> str:
    """The trainer ranks (or whichever `roles_prefix` names): those inside torch.distributed, those
    not (the ones the others wait for), and any stopped or gone."""
    ranks = [s for s in found if s.role.startswith(roles_prefix) and s.pid and " " not in s.role[len(roles_prefix) + 1:]]
    return "; ".join(s.describe() for s in ranks)

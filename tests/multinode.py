"""A Ray cluster of real nodes on this one machine, for the multi-node tests.

A node is a Linux network namespace (its own address on a private bridge, reachable from the
other nodes and from nowhere else) plus a mount namespace (its own /dev/shm, its own Ray temp
directory, and its own scratch directory bound over `NamespaceCluster.local_path`). Every other
path is the machine's one filesystem: the cluster's shared storage. `ray start` runs a real head
and real workers there, so placement, cross-node HTTP, gloo, object transfer and node loss are
real; NCCL and CUDA IPC are not (no GPU).

Layout (all made here, all removed by `close`, also after a failure):
- network namespaces `rlmn<pid>-<n>-<node>` (one per node) and `rlmn<pid>-<n>-sw` (the bridge,
  with one veth pair per node), n numbering the clusters of this process; node i answers at
  10.A.B.(10+i) on its `eth0`, where A.B come from this process's pid. No address is added to the
  machine's own namespace and there is no default route: traffic stays between the fixture's
  namespaces.
- per node, an anchor process (`sleep`) that holds its namespaces, so that its /dev/shm can be
  read and processes started in it at any time; "every process of a node" means every process
  in its network namespace but the anchor.
- WORKDIR/nodes/<node>/{ray,local}: the node's Ray temp directory (bound over /tmp/ray) and its
  scratch directory (bound over WORKDIR/local).

Needs root (namespaces, mounts); `unavailable_reason()` says why it cannot run here. Namespaces
left by a test run that was killed (its pid gone) are removed at the next start.

    python -m tests.multinode up     # a head and two workers, for trying things by hand
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rlsys.system.reaper import kill_and_wait

PREFIX = "rlmn"
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
RAY_TEMP = Path("/tmp/ray")  # Ray's default temp dir; each node binds its own over it
SHM_SIZE = "2g"
_CLUSTER_NUMBERS = itertools.count()  # several clusters of one process get distinct namespace names


def unavailable_reason() -> str | None:
    """Why a namespace cluster cannot be built on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def processes_in_netns(name: str) -> list[psutil.Process]:
    """Every process whose network namespace is `name` (whatever its parent)."""
    inode = _netns_inode(name)
    if inode is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                found.append(psutil.Process(int(entry)))
        except (OSError, psutil.Error):
            continue
    return found


def _kill(processes: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM (grace_s > 0) then SIGKILL, and wait until they are gone."""
    if grace_s > 0:
        for process in processes:
            try:
                process.terminate()
            except psutil.Error:
                pass
        _, processes = psutil.wait_procs(processes, timeout=grace_s)
    kill_and_wait(processes, 10.0)


def _remove_netns(name: str) -> None:
    _kill(processes_in_netns(name), grace_s=0)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def sweep_stale_namespaces() -> list[str]:
    """Remove namespaces of this module whose creating process is gone (a killed test run)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    removed = []
    for name in listed:
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        owner = name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            _remove_netns(name)
            removed.append(name)
    return removed


def our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in listed if name.startswith(f"{PREFIX}{os.getpid()}-")]


@dataclass(frozen=True)
class NodeSpec:
    """A node to start: logical CPUs and custom resources as `ray start` takes them."""

    name: str
    num_cpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)
    ray: bool = True  # False: only the namespaces (tests of the fixture itself)


@dataclass
class Node:
    spec: NodeSpec
    index: int
    address: str
    netns: str
    anchor: subprocess.Popen | None = None
    ray_log: Path | None = None

    @property
    def name(self) -> str:
        return self.spec.name


class NamespaceCluster:
    """A head and workers, each in its own namespaces (module docstring). Use as a context manager."""

    def __init__(self, workdir: Path, head: NodeSpec, workers: list[NodeSpec], env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.local_path = self.workdir / "local"  # each node sees its own files here
        self.shared_path = self.workdir / "shared"  # every node sees the same files here
        pid = os.getpid()
        self.subnet = f"10.{200 + (pid >> 8) % 50}.{pid % 256}"  # each cluster has a bridge of its own
        self.name_prefix = f"{PREFIX}{pid}-{next(_CLUSTER_NUMBERS)}-"
        self.switch = f"{self.name_prefix}sw"
        self.nodes: dict[str, Node] = {}
        self._specs = [head, *workers]
        self.head_name = head.name
        self.env = self._ray_env(env or {})

    # ---- life ---------------------------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        sweep_stale_namespaces()
        self.local_path.mkdir(parents=True, exist_ok=True)
        self.shared_path.mkdir(parents=True, exist_ok=True)
        RAY_TEMP.mkdir(exist_ok=True)  # a mount point only: nodes bind their own directory over it
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for spec in self._specs:
            self.add_node(spec)

    def add_node(self, spec: NodeSpec) -> Node:
        """Create the node's namespaces and start Ray there (the head first; workers join it).
        Workers start one at a time: two `ray start`s at once on 2 busy cores can time out."""
        if spec.name in self.nodes:
            raise ValueError(f"node {spec.name} exists")
        index = len(self.nodes)
        node = Node(spec, index, f"{self.subnet}.{10 + index}", f"{self.name_prefix}{spec.name}")
        self.nodes[spec.name] = node
        _ip("netns", "add", node.netns)
        _ip("link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0", "netns", node.netns,
            netns=self.switch)
        _ip("link", "set", f"v{index}", "master", "br0", netns=self.switch)
        _ip("link", "set", f"v{index}", "up", netns=self.switch)
        _ip("addr", "add", f"{node.address}/24", "dev", "eth0", netns=node.netns)
        _ip("link", "set", "eth0", "up", netns=node.netns)
        _ip("link", "set", "lo", "up", netns=node.netns)
        self._start_anchor(node)
        if spec.ray:
            self.start_ray(spec.name)
        return node

    def _node_dir(self, node: Node) -> Path:
        return self.workdir / "nodes" / node.name

    def _start_anchor(self, node: Node) -> None:
        """A process that holds the node's mount namespace: its /dev/shm, Ray temp dir and scratch."""
        ray_dir, local_dir = self._node_dir(node) / "ray", self._node_dir(node) / "local"
        ray_dir.mkdir(parents=True, exist_ok=True)
        local_dir.mkdir(parents=True, exist_ok=True)
        script = (f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && mount --bind {ray_dir} {RAY_TEMP} "
                  f"&& mount --bind {local_dir} {self.local_path} && echo ready && exec sleep infinity")
        node.anchor = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = node.anchor.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"node {node.name}: namespace set-up failed: {node.anchor.stderr.read()[-2000:]}")

    def _ray_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("RAY_") and key not in ("PYTEST_CURRENT_TEST",)}
        env.update({
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "RAY_AUTH_MODE": "disabled",  # a cluster nothing outside these namespaces can reach
            # Notice a lost node in ~3 s instead of Ray's ~15-30 s default (GCS health checks).
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_initial_delay_ms": "1000",
        })
        env.update(extra)
        return env

    def start_ray(self, name: str) -> None:
        """`ray start` on the node (returns once the node has joined); its processes stay in the
        node's namespaces."""
        node = self.nodes[name]
        head = self.nodes[self.head_name]
        common = [f"--node-ip-address={node.address}", f"--num-cpus={node.spec.num_cpus}",
                  "--disable-usage-stats", "--object-store-memory=100000000"]
        if node.spec.resources:
            import json

            common.append(f"--resources={json.dumps(node.spec.resources)}")
        if name == self.head_name:
            command = [RAY, "start", "--head", "--port=6379", "--dashboard-host=0.0.0.0", "--dashboard-port=8265",
                       "--include-dashboard=true", *common]
        else:
            command = [RAY, "start", f"--address={head.address}:6379", *common]
        node.ray_log = self._node_dir(node) / "ray-start.log"
        with open(node.ray_log, "ab") as log:
            started = subprocess.run(self.on_node(name, command), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     timeout=300)
        if started.returncode != 0:
            raise RuntimeError(f"ray start on node {name} failed; see {node.ray_log}:\n"
                               + node.ray_log.read_text()[-3000:])

    def close(self) -> None:
        """Stop every process of every node and remove namespaces, links, mounts and directories."""
        everyone = [p for node in self.nodes.values() for p in processes_in_netns(node.netns)
                    if node.anchor is None or p.pid != node.anchor.pid]
        _kill(everyone, grace_s=5)  # every node at once: one grace period, not one per node
        for node in self.nodes.values():
            if node.anchor is not None:
                node.anchor.kill()
                node.anchor.wait()
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        self.nodes = {}
        shutil.rmtree(self.workdir / "nodes", ignore_errors=True)

    # ---- using the nodes ----------------------------------------------------------------
    @property
    def head_address(self) -> str:
        return self.nodes[self.head_name].address

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head_address}:8265"

    def on_node(self, name: str, argv: list[str], network_only: bool = False) -> list[str]:
        """`argv` as a command that runs in the node's namespaces (its network only: a client)."""
        anchor = self.nodes[name].anchor.pid
        return ["nsenter", "-t", str(anchor), "-n", *([] if network_only else ["-m"]), "--", *argv]

    def run_on(self, name: str, argv: list[str], timeout_s: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.on_node(name, argv), env=kwargs.pop("env", self.env), capture_output=True,
                              text=True, timeout=timeout_s, **kwargs)

    def processes(self, name: str) -> list[psutil.Process]:
        """Every process of the node (in its network namespace) but its anchor."""
        node = self.nodes[name]
        return [p for p in processes_in_netns(node.netns) if p.pid != node.anchor.pid]

    def node_of(self, pid: int) -> str | None:
        """The node a process runs on."""
        try:
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        return next((n.name for n in self.nodes.values() if _netns_inode(n.netns) == inode), None)

    def find(self, substring: str, node: str | None = None) -> list[psutil.Process]:
        """Processes of the cluster (or of one node) whose command line contains `substring`."""
        names = [node] if node else list(self.nodes)
        found = []
        for name in names:
            for process in self.processes(name):
                try:
                    if substring in " ".join(process.cmdline()):
                        found.append(process)
                except psutil.Error:
                    continue
        return found

    def shm_files(self, name: str) -> list[str]:
        """The node's /dev/shm, as its own processes see it."""
        return sorted(os.listdir(f"/proc/{self.nodes[name].anchor.pid}/root/dev/shm"))

    def kill_node(self, name: str) -> int:
        """SIGKILL every process of the node (its Ray daemons, workers, engines), as a machine
        that loses power; the node's namespaces stay, so Ray can be started there again."""
        victims = self.processes(name)
        _kill(victims, grace_s=0)
        return len(victims)

    def submit(self, config: str, *overrides: str, repo: Path, wait: bool = True,
               timeout_s: float = 900) -> subprocess.CompletedProcess | subprocess.Popen:
        """`deploy/submit.sh --address HEAD CONFIG OVERRIDES` from inside the head's network (the
        command a user types); blocks until the job ends unless `wait` is False."""
        argv = self.on_node(self.head_name, ["bash", str(repo / "deploy/submit.sh"), "--address", self.dashboard_url,
                                             config, *overrides], network_only=True)
        if wait:
            return subprocess.run(argv, env=self.env, cwd=repo, capture_output=True, text=True, timeout=timeout_s)
        return subprocess.Popen(argv, env=self.env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def wait_for(self, condition, what: str, timeout_s: float = 600, poll_s: float = 0.5):
        """Poll `condition()` until it returns something truthy; a hang guard, not a timing check."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not after {timeout_s:.0f}s")
            time.sleep(poll_s)


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up"])
    parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"multinode: {reason}")
    workdir = Path(tempfile.mkdtemp(prefix="rlmn-"))
    with NamespaceCluster(workdir, NodeSpec("head"), [NodeSpec("a", 2, {"trainer_node": 8}),
                                                      NodeSpec("b", 2, {"engine_node": 8})]) as cluster:
        for node in cluster.nodes.values():
            print(f"{node.name}: {node.address}  (nsenter -t {node.anchor.pid} -n -m)")
        print(f"dashboard {cluster.dashboard_url}; shared {cluster.shared_path}; Ctrl-C to stop")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `close` runs on the way out
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()

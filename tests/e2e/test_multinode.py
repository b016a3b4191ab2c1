"""rlsys on a Ray cluster of several real nodes (tests/multinode.py: network and mount namespaces
on this one machine): the driver on a head that offers no CPUs to actors (as a KubeRay head with
num-gpus 0), trainer ranks and engines on worker nodes, run_dir on the storage every node sees.
Every run is submitted with deploy/submit.sh against the head, as a user would.

Nodes: head (0 CPUs); a (4 CPUs, `trainer_node`); b and c (2 CPUs each, `engine_node`). Runs keep
trainers and engines apart with placement.trainer_node_resources / engine_node_resources. Every node
has a hub cache of its own (HF_HUB_CACHE on node-local storage, HF_HUB_OFFLINE=1): the colocated runs
name their model by hub id, which the head and node a hold. What this cannot show: NCCL and CUDA
IPC (no GPU here)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, check_tracking, fill_hub_cache
from tests.multinode import SHM_SIZE, NamespaceCluster, NodeSpec, our_namespaces, unavailable_reason

TRAINER_NODE = {"trainer_node": 8}
ENGINE_NODE = {"engine_node": 8}
ON_TRAINER_NODES = "placement.trainer_node_resources={trainer_node: 1}"
ON_ENGINE_NODES = "placement.engine_node_resources={engine_node: 1}"
QUIET = ("logging.progress_bar=false", "status.port=0")
# Columns a resumed run must reproduce exactly: which step, which prompts, which weights sampled them.
SAME_AFTER_RESUME = ("step", "data_epoch", "data_index", "weight_version", "synced_weight_version")
HUB_ID = "tiny-org/tiny-qwen"  # in the hub caches of the head and node a
HEAD_ONLY = "tiny-org/head-only"  # in the head's only


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-node tests must run in CI: {reason}")
        pytest.skip(f"no multi-node test cluster here: {reason}")
    workdir = tmp_path_factory.mktemp("cluster")
    hub_env = {"HF_HUB_CACHE": str(workdir / "local" / "hub"), "HF_HUB_OFFLINE": "1"}  # node-local (docstring)
    with NamespaceCluster(workdir, NodeSpec("head"), [NodeSpec("a", 4, TRAINER_NODE), NodeSpec("b", 2, ENGINE_NODE),
                                                      NodeSpec("c", 2, ENGINE_NODE)], env=hub_env) as made:
        yield made
    assert our_namespaces() == []  # namespaces, links and the nodes' processes are gone with them


def test_the_nodes_are_separate_machines_that_share_one_storage(cluster, tmp_path):
    addresses = [node.address for node in cluster.nodes.values()]
    assert len(set(addresses)) == 4
    for name, node in cluster.nodes.items():
        shown = cluster.run_on(name, ["ip", "-4", "-o", "addr", "show", "eth0"])
        assert f"inet {node.address}/24" in shown.stdout
    # each node its own /dev/shm and scratch directory; what is written elsewhere is shared
    assert cluster.run_on("a", ["sh", "-c", f"echo a > /dev/shm/probe-a && echo a > {cluster.local_path}/probe-a "
                                            f"&& echo a > {tmp_path}/probe-a"]).returncode == 0
    assert "probe-a" in cluster.shm_files("a") and "probe-a" not in cluster.shm_files("b")
    seen_from_b = cluster.run_on("b", ["sh", "-c", f"ls {cluster.local_path}; cat {tmp_path}/probe-a"])
    assert "probe-a" not in seen_from_b.stdout.splitlines()[:-1] and seen_from_b.stdout.splitlines()[-1] == "a"
    cluster.run_on("a", ["rm", "/dev/shm/probe-a", f"{cluster.local_path}/probe-a"])
    # the nodes reach each other; nothing outside the cluster's namespaces has their addresses
    reach = cluster.run_on("a", [sys.executable, "-c", "import socket; socket.create_connection("
                                 f"('{cluster.head_address}', 8265), timeout=5).close()"])
    assert reach.returncode == 0, reach.stderr
    routes = cluster.run_on("a", ["ip", "-4", "route"]).stdout
    assert "default" not in routes


def test_a_cluster_is_removed_whole_when_the_test_using_it_fails(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    import subprocess

    import psutil

    before = set(our_namespaces())
    with pytest.raises(RuntimeError, match="the test failed"):
        with NamespaceCluster(tmp_path, NodeSpec("head", ray=False), [NodeSpec("w", ray=False)]) as small:
            made = set(our_namespaces()) - before
            # a daemon of the node, in its own session (as Ray's are): found by its namespace, not its parent
            subprocess.run(small.on_node("w", ["setsid", "-f", "sleep", "600"]), check=True)
            anchors = [node.anchor.pid for node in small.nodes.values()]
            daemons = [p.pid for p in small.processes("w")]
            assert len(made) == 3 and len(daemons) == 1  # two nodes and the bridge's namespace
            raise RuntimeError("the test failed")
    assert set(our_namespaces()) == before
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in anchors + daemons)
    assert not (tmp_path / "nodes").exists()


def _submit(cluster: NamespaceCluster, config: str, model_dir: Path, *overrides: str, wait: bool = True):
    return cluster.submit(f"configs/{config}", f"model.path={model_dir}", *QUIET, *overrides, repo=REPO, wait=wait)


def _succeeded(job) -> str:
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-4000:]
    return output


def _nodes_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("rlsys: nodes: "))


def _steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _run_processes(cluster: NamespaceCluster, before: set[int]) -> list[str]:
    """Processes a run started, on any node: its driver and reaper, trainer and engine actors,
    SGLang servers (Ray's own node daemons are not the run's)."""
    found = []
    for name in cluster.nodes:
        for process in cluster.processes(name):
            if process.pid in before:
                continue
            try:
                cmdline = " ".join(process.cmdline())
            except Exception:  # noqa: BLE001 - exited meanwhile
                continue
            if "rlsys" in cmdline or "sglang" in cmdline or "ray::TrainerWorker" in cmdline \
                    or "ray::RolloutEngine" in cmdline:
                found.append(f"{name}: {process.pid} {cmdline[:100]}")
    return found


def _all_pids(cluster: NamespaceCluster) -> set[int]:
    return {process.pid for name in cluster.nodes for process in cluster.processes(name)}


def _shm(cluster: NamespaceCluster) -> dict[str, set[str]]:
    return {name: set(cluster.shm_files(name)) for name in cluster.nodes}


@pytest.fixture(scope="module")
def hub_caches(cluster, tiny_model_dir):
    """The tiny model in the node-local hub caches: HUB_ID on the head and node a, HEAD_ONLY on the head."""
    for node in ("head", "a"):
        fill_hub_cache(cluster.workdir / "nodes" / node / "local" / "hub", HUB_ID, tiny_model_dir)
    fill_hub_cache(cluster.workdir / "nodes" / "head" / "local" / "hub", HEAD_ONLY, tiny_model_dir)


@pytest.fixture(scope="module")
def colocated_run(cluster, hub_caches, tmp_path_factory):
    """Colocated, 2 ranks and their engine on worker node a, the driver on the head, the model by hub
    id: 6 steps, checkpoints every 2 (the uninterrupted run the resume test compares with). The fresh
    cluster's first job (keep it first: Ray deletes and unpacks again a fresh cluster's first
    working_dir under its driver, which once failed the reward pool's start)."""
    run_dir = tmp_path_factory.mktemp("shared") / "colocated"
    job = _submit(cluster, "quickstart.yaml", HUB_ID, f"run_dir={run_dir}", *COLOCATED)
    return run_dir, _succeeded(job)


COLOCATED = ("trainer.num_ranks=2", "trainer.total_steps=6", "checkpoint.interval=2", "eval.interval=3",
             ON_TRAINER_NODES)


def test_colocated_ranks_on_one_worker_node_with_the_driver_on_the_head(cluster, colocated_run):
    run_dir, output = colocated_run
    head, worker = cluster.nodes["head"].address, cluster.nodes["a"].address
    assert _nodes_line(output) == f"rlsys: nodes: driver {head}; {worker}: trainer rank 0, engine-0, trainer rank 1"
    assert "rlsys: finished" in output
    # The hub id resolved in the head's cache, and node a found the same commit at the same path in its own.
    assert f"model {HUB_ID} at commit {'1a2b3c4d' * 5}: {cluster.local_path}/hub/models--tiny-org--tiny-qwen" in output
    # The memory plan's budget is the worker's (its RAM on CPU; a GPU there), not the head's.
    assert f"GiB (the RAM of node {worker} (" in output
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3  # the engine holds the trainer's weights
    # Checkpoints written by the ranks on node a and renamed by the driver on the head are whole.
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000006"]  # checkpoint.keep_last: 2; no partial left behind
    for name in kept:
        checkpoint = run_dir / "checkpoints" / name
        assert (checkpoint / "coordinator.json").is_file() and (checkpoint / "dcp" / ".metadata").is_file()
        assert {p.name for p in checkpoint.glob("trainer_rank*.pt")} == {"trainer_rank0.pt", "trainer_rank1.pt"}
    # The engine's log, written on node a, says it listens on that node's address (not loopback).
    assert f"Uvicorn running on http://{worker}:" in (run_dir / "logs" / "engine_0.log").read_text()
    # What the run wrote is readable from the head, in its own mount namespace.
    listed = cluster.run_on("head", [sys.executable, "-m", "rlsys.cli", "runs", str(run_dir.parent)], cwd=REPO,
                            env={**cluster.env, "COLUMNS": "200"})
    assert listed.returncode == 0, listed.stderr
    (line,) = [line for line in listed.stdout.splitlines() if "colocated" in line]
    assert "finished" in line and "6 / 6" in line


def test_a_run_dir_the_worker_nodes_cannot_see_is_refused_before_anything_trains(cluster, tiny_model_dir):
    """A path on the head's own disk (node-local scratch; like an emptyDir on a KubeRay head)."""
    run_dir = cluster.local_path / "run"
    job = _submit(cluster, "quickstart.yaml", tiny_model_dir, f"run_dir={run_dir}", ON_TRAINER_NODES)
    output = job.stdout + job.stderr
    assert job.returncode != 0
    assert f"run_dir {run_dir} is not on storage that every node of the run sees" in output, output[-3000:]
    trainer_node = cluster.nodes["a"].address
    assert f"node {trainer_node} (" in output and "trainer rank 0" in output
    assert "does not see the driver's files there" in output and "Set run_dir to a directory on a filesystem" in output
    # Nothing was trained or checkpointed: on the head the run directory holds the driver's own
    # files only, and no node wrote anything of it.
    head_copy = cluster.workdir / "nodes" / "head" / "local" / "run"
    assert not (head_copy / "checkpoints").exists() and not (head_copy / "metrics.jsonl").exists()
    assert json.loads((head_copy / "status.json").read_text())["state"] == "failed"
    assert not (cluster.workdir / "nodes" / "a" / "local" / "run").exists()


def test_a_hub_id_a_worker_node_cannot_resolve_is_refused_naming_the_node(cluster, hub_caches, tmp_path):
    job = _submit(cluster, "quickstart.yaml", HEAD_ONLY, f"run_dir={tmp_path / 'run'}", ON_TRAINER_NODES)
    output = job.stdout + job.stderr
    assert job.returncode != 0
    assert f"model {HEAD_ONLY} at commit" in output, output[-3000:]  # the driver resolved it in the head's cache
    assert "is not on every node that loads it" in output, output[-3000:]
    assert f"node {cluster.nodes['a'].address} (" in output
    assert f"{HEAD_ONLY} at 1a2b3c4d1a2b is not in this node's hub cache" in output and "HF_HUB_OFFLINE" in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# The doctor's run: trainer rank 0 on node a, one engine on each of b and c (5 of a node's 8 engine_node).
DOCTOR_RUN = ("trainer.num_ranks=1", "rollout.num_engines=2", ON_TRAINER_NODES,
              "placement.engine_node_resources={engine_node: 5}", "status.port=0")


def _doctor(cluster: NamespaceCluster, model_dir: Path, run_dir: Path) -> tuple[int, dict, str]:
    """`rlsys doctor --json` on the head, as an operator would run it there before a job."""
    done = cluster.run_on("head", [sys.executable, "-m", "rlsys.cli", "doctor",
                                   str(REPO / "configs" / "quickstart_disaggregated.yaml"), f"model.path={model_dir}",
                                   f"run_dir={run_dir}", *DOCTOR_RUN, "--address", f"{cluster.head_address}:6379",
                                   "--json"], cwd=REPO, timeout_s=300)
    assert done.stdout.strip(), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def _node_problems(report: dict, address: str) -> list[str]:
    return [p["what"] for p in report["problems"] if p["where"].startswith(f"node {address} (")]


def test_the_doctor_passes_a_healthy_cluster_and_measures_its_links(cluster, tiny_model_dir, tmp_path):
    code, report, stderr = _doctor(cluster, tiny_model_dir, tmp_path / "runs" / "doctor")
    assert code == 0 and report["ok"] and report["problems"] == [], (report["problems"], stderr[-2000:])
    a, b, c = (cluster.nodes[name].address for name in "abc")
    roles = {row["report"]["address"]: row["report"]["roles"] for row in report["nodes"]}
    assert roles == {a: ["trainer rank 0"], b: ["engine-0"], c: ["engine-1"]} or \
        roles == {a: ["trainer rank 0"], b: ["engine-1"], c: ["engine-0"]}
    for row in report["nodes"]:
        assert row["report"]["versions"]["sglang"] == report["driver_versions"]["sglang"]
        assert row["report"]["shm_free_bytes"] >= row["shm_needed_bytes"] and row["unreachable"] == []
        assert abs(row["clock_skew_s"]) < 1.0  # one machine's clock
    collectives = report["collectives"]
    assert collectives["backend"] == "gloo" and sorted(collectives["nodes"]) == sorted([a, b, c])
    assert len(collectives["broadcast_gbps"]) == 3 and all(v > 0 for v in collectives["broadcast_gbps"].values())
    assert collectives["all_reduce_bus_gbps"] > collectives["bound_gbps"] > 0
    assert not (tmp_path / "runs").exists()  # what the doctor made for its check is gone


def test_the_doctor_names_each_node_that_cannot_run_its_part(cluster, tiny_model_dir, tmp_path):
    """Node a with another sglang in its environment, b with a small /dev/shm, c behind a firewall
    that drops new connections to its free ports and with another directory at run_dir."""
    import importlib.metadata
    import re

    a, b, c = (cluster.nodes[name].address for name in "abc")
    metadata = Path(importlib.metadata.distribution("sglang")._path) / "METADATA"
    other_sglang = tmp_path / "METADATA"
    other_sglang.write_text(re.sub(r"^Version: .*$", "Version: 0.5.22", metadata.read_text(), count=1, flags=re.M))
    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    used = int(cluster.run_on("b", ["df", "-B1", "--output=used", "/dev/shm"]).stdout.split()[-1])
    listening = {int(line.split()[3].rsplit(":", 1)[1])
                 for line in cluster.run_on("c", ["ss", "-ltnH"]).stdout.splitlines() if line.strip()}
    first = next(start for start in range(40000, 60000, 500) if not any(start <= p < start + 500 for p in listening))
    ports = f"{first}:{first + 499}"
    firewall = ["iptables", "-A", "INPUT", "-p", "tcp", "--syn", "--dport", ports, "-j", "DROP"]
    changes = [  # (node, do, undo)
        ("a", ["mount", "--bind", str(other_sglang), str(metadata)], ["umount", str(metadata)]),
        ("b", ["mount", "-o", f"remount,size={used + 16 * 2**20}", "/dev/shm"],
         ["mount", "-o", f"remount,size={SHM_SIZE}", "/dev/shm"]),
        ("c", ["mount", "--bind", str(tmp_path / "elsewhere"), str(tmp_path / "runs")], ["umount", str(tmp_path / "runs")]),
        ("c", ["sysctl", "-qw", f"net.ipv4.ip_local_port_range={first} {first + 499}"],
         ["sysctl", "-qw", "net.ipv4.ip_local_port_range=32768 60999"]),
        ("c", firewall, ["iptables", "-D", *firewall[2:]]),
    ]
    done = []
    try:
        for node, do, undo in changes:
            made = cluster.run_on(node, do)
            assert made.returncode == 0, f"{node}: {' '.join(do)}: {made.stderr}"
            done.append((node, undo))
        code, report, stderr = _doctor(cluster, tiny_model_dir, tmp_path / "runs" / "doctor")
    finally:
        for node, undo in reversed(done):
            cluster.run_on(node, undo)
    assert code == 1 and not report["ok"], stderr[-2000:]
    assert any("sglang 0.5.22 here, 0.5.23 on the driver and the other nodes" in what
               for what in _node_problems(report, a)), report["problems"]
    assert any("/dev/shm has" in what and "the run needs 64 MiB there" in what
               for what in _node_problems(report, b)), report["problems"]
    unreachable = [what for what in _node_problems(report, c) if "cannot be reached from" in what]
    assert {what.split("cannot be reached from ")[1].split(":")[0] for what in unreachable} == \
        {a, b, f"the driver ({cluster.head_address})"}, unreachable
    (run_dir_refusal,) = [p["what"] for p in report["problems"] if "is not on storage that every node" in p["what"]]
    assert f"node {c} (" in run_dir_refusal and "does not see the driver's files there" in run_dir_refusal
    assert a not in run_dir_refusal and b not in run_dir_refusal
    assert "cannot reach each other's ports" in report["collectives"]["skipped"]
    # each problem names only its own node: a's and b's ports, c's /dev/shm and sglang were fine
    assert not any("cannot be reached" in what for what in _node_problems(report, a) + _node_problems(report, b))
    assert cluster.run_on("b", ["df", "-B1", "--output=size", "/dev/shm"]).stdout.split()[-1] == str(2 * 2**30)


@pytest.mark.own_engines
def test_a_killed_driver_leaves_nothing_on_any_node_and_the_run_resumes_as_if_uninterrupted(
        cluster, tiny_model_dir, colocated_run, tmp_path):
    reference = read_metrics(colocated_run[0] / "metrics.jsonl")
    run_dir = tmp_path / "killed"
    before_pids, before_shm = _all_pids(cluster), _shm(cluster)
    job = _submit(cluster, "quickstart.yaml", HUB_ID, f"run_dir={run_dir}", *COLOCATED, wait=False)
    cluster.wait_for(lambda: (run_dir / "checkpoints" / "step_00000002" / "coordinator.json").exists()
                     or job.poll() is not None, "the run's step-2 checkpoint")
    assert job.poll() is None, job.stdout.read()[-3000:]
    assert _run_processes(cluster, before_pids)  # running: trainers, engine, reapers
    (driver,) = [p for p in cluster.find("rlsys.cli train", "head") if p.cmdline()[:1] == ["python"]]
    killed_at = time.monotonic()
    driver.kill()

    def nothing_left():
        shm = _shm(cluster)
        new_files = {name: sorted(shm[name] - before_shm[name]) for name in shm if shm[name] - before_shm[name]}
        return not _run_processes(cluster, before_pids) and not new_files

    cluster.wait_for(nothing_left, "no process and no /dev/shm file of the killed run on any node", timeout_s=120)
    print(f"killed driver: every node clean after {time.monotonic() - killed_at:.1f} s")
    job.wait(timeout=120)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "died without finishing" in status["error"]

    resumed = _succeeded(_submit(cluster, "quickstart.yaml", HUB_ID, f"run_dir={run_dir}", *COLOCATED,
                                 "--resume"))
    checkpoint = next(line for line in resumed.splitlines() if "rlsys: resuming from" in line)
    resumed_from = int(checkpoint.rsplit("step_", 1)[1])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))  # no step lost, none logged twice
    assert [{k: r[k] for k in SAME_AFTER_RESUME} for r in rows[resumed_from:]] == \
        [{k: r[k] for k in SAME_AFTER_RESUME} for r in reference[resumed_from:]]
    assert rows[resumed_from]["logprob_mismatch"] < 1e-3  # the engine restarted on the checkpointed weights


@pytest.mark.own_engines
def test_disaggregated_ranks_broadcast_to_an_engine_on_another_node_and_learn_through_both_nodes_lost(
        cluster, tiny_model_dir, tmp_path):
    """One fault-injection run, three subjects, each asserted on its own with a message naming it:
    disaggregated ranks on a trainer node broadcast to an engine on an engine node and learn; when the
    engine's node is lost (during step 2), the engine is started again on the other engine node with
    room and the run goes on with no step lost; when the trainers' node is lost after that (after the
    step-3 checkpoint), the trainers resume from that checkpoint on the spare trainer node and the run
    goes on to learn. (An engine's death is its subject: own_engines.)"""
    spare = cluster.nodes.get("spare") or cluster.add_node(NodeSpec("spare", 4, TRAINER_NODE))
    run_dir = tmp_path / "disaggregated"
    job = _submit(cluster, "quickstart_disaggregated.yaml", tiny_model_dir, f"run_dir={run_dir}",
                  "trainer.num_ranks=2", "rollout.num_engines=1", "eval.stop_at_reward=0.9",
                  "logging.backends=[tensorboard,wandb,mlflow]", "checkpoint.interval=3",
                  "checkpoint.max_auto_resumes=1", ON_TRAINER_NODES, ON_ENGINE_NODES, wait=False)
    lost = {}  # fault -> the node it took
    try:
        cluster.wait_for(lambda: _steps_done(run_dir) >= 2 or job.poll() is not None, "2 steps")
        assert job.poll() is None, "engine node lost: the run ended before it: " + job.stdout.read()[-3000:]
        (server,) = cluster.find("sglang.launch_server")
        lost["engine"] = cluster.node_of(server.pid)
        assert cluster.kill_node(lost["engine"]) > 0  # its raylet, Ray daemons, engine actor, SGLang server, reapers

        def engine_back_and_checkpointed():
            rows = read_metrics(run_dir / "metrics.jsonl") if _steps_done(run_dir) else []
            return (any(r["engine_restarts"] >= 1 for r in rows)
                    and (run_dir / "checkpoints" / "step_00000003" / "coordinator.json").exists())

        cluster.wait_for(lambda: engine_back_and_checkpointed() or job.poll() is not None,
                         "the engine back and the step-3 checkpoint")
        assert job.poll() is None, "trainer node lost: the run ended before it: " + job.stdout.read()[-3000:]
        lost["trainer"] = cluster.node_of(cluster.find("ray::TrainerWorker")[0].pid)  # node a or the spare
        assert cluster.kill_node(lost["trainer"]) > 0
        output = job.communicate(timeout=1800)[0]
        assert job.returncode == 0, output[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
        for node in lost.values():
            cluster.start_ray(node)  # the nodes come back for the tests after this one
    said = "\n".join(line for line in output.splitlines() if line.startswith("rlsys: "))
    rows = read_metrics(run_dir / "metrics.jsonl")

    # where the parts ran: both ranks on the trainer node Ray chose, the engine on an engine node
    trainer_nodes = {cluster.nodes["a"].address, cluster.nodes[spare.name].address}
    engine_nodes = {cluster.nodes["b"].address, cluster.nodes["c"].address}
    nodes = dict(part.split(": ") for part in _nodes_line(output).removeprefix("rlsys: nodes: ").split("; ")[1:])
    assert nodes[cluster.nodes[lost["trainer"]].address] == "trainer rank 0, trainer rank 1", nodes
    ((engine_node, roles),) = [(node, roles) for node, roles in nodes.items() if node not in trainer_nodes]
    assert engine_node == cluster.nodes[lost["engine"]].address and roles == "engine-0", nodes

    # the engine's node lost: said, and the engine back on the other engine node, no step lost
    survivor = ({"b", "c"} - {lost["engine"]}).pop()
    assert f"rlsys: engine-0 died; restarting it (1 of 3): node {cluster.nodes[lost['engine']].address}" in said, \
        "engine node lost: " + said
    assert f"rlsys: engine-0 is back, on node {cluster.nodes[survivor].address}" in said, "engine node lost: " + said
    assert cluster.nodes[survivor].address in engine_nodes
    assert rows[-1]["engine_restarts"] == 1, "engine node lost: restarted more than once"

    # the trainers' node lost: said, and the trainers back on the other trainer node from the checkpoint
    (other,) = {"a", spare.name} - {lost["trainer"]}
    assert "rlsys: a trainer rank died (" in said and f"rank 0 on node {cluster.nodes[lost['trainer']].address}" \
        in said, "trainer node lost: " + said
    assert f"rlsys: trainer ranks are back, on node(s) {cluster.nodes[other].address}" in said, \
        "trainer node lost: " + said
    assert rows[-1]["trainer_restarts"] == 1, "trainer node lost: restarted more than once"

    # through both: no step lost, the replayed ones logged once, every sync verified
    assert [r["step"] for r in rows] == list(range(len(rows)))
    assert [r["synced_weight_version"] for r in rows] == list(range(1, len(rows) + 1))
    # weight_sync.verify (this config's): after every sync over the cross-node gloo group, the restarted
    # engine's and the resumed trainers' syncs included, the engine's log-probs on the probe sequences
    # matched the trainer's, or the run would have failed.
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3

    # and it learned
    assert rows[-1]["eval_reward_mean"] >= 0.9
    assert not (run_dir / "logs" / "device_handoff.jsonl").exists()  # disaggregated trainers keep their devices
    check_tracking(run_dir, rows)

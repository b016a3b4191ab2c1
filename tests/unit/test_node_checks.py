"""What every node of the placement must offer before anything trains (rlsys/system/node_checks.py), and
the address, key and gloo interface each process of a run uses to be reached from other nodes.
(`rlsys doctor` running them on this machine, on a Ray cluster of its own: tests/e2e/test_node_checks.py.)"""

import os
import socket

import pytest

from rlsys.config import ConfigError, RunConfig
from rlsys.system.node import GLOO_INTERFACE_ENV, gloo_interface_env, interface_with_address
from rlsys.system.node_checks import (
    NodeCheckFailed,
    NodeReport,
    _run_dir_problem,
    device_memory_budget,
    refuse_unusable_nodes,
)
from rlsys.system.topology import Topology

GB = 2**30


def _report(address, roles, run_dir_problem=None, model_problem=None, gpu=None, ram=64 * GB):
    return NodeReport(node_id=address, address=address, hostname=f"host-{address[-1]}", roles=tuple(roles),
                      run_dir_problem=run_dir_problem, model_problem=model_problem, host_memory_bytes=ram,
                      gpu_memory_bytes=gpu, flash_attn_installed=False)


def test_a_node_that_sees_the_drivers_file_and_can_write_passes(tmp_path):
    (tmp_path / "marker").write_text("token-1")
    assert _run_dir_problem(tmp_path, "marker", "token-1") is None
    assert sorted(os.listdir(tmp_path)) == ["marker"]  # its own probe file is gone again


def test_a_node_whose_run_dir_is_another_directory_is_caught(tmp_path):
    assert "does not see the driver's files" in _run_dir_problem(tmp_path, "marker", "token-1")
    (tmp_path / "marker").write_text("token-of-another-run")
    assert "another run's check file" in _run_dir_problem(tmp_path, "marker", "token-1")


def test_a_read_only_run_dir_is_caught(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    (tmp_path / "marker").write_text("t")
    tmp_path.chmod(0o555)
    try:
        assert "cannot write there" in _run_dir_problem(tmp_path, "marker", "t")
    finally:
        tmp_path.chmod(0o755)


def test_refusal_names_every_node_that_cannot_see_the_run_dir_and_what_to_set():
    reports = [_report("10.0.0.11", ["trainer rank 0", "trainer rank 1"]),
               _report("10.0.0.12", ["engine-0"], run_dir_problem="does not see the driver's files there")]
    with pytest.raises(NodeCheckFailed) as caught:
        refuse_unusable_nodes(reports, __import__("pathlib").Path("/local/runs/a"), ("/models/m",))
    message = str(caught.value)
    assert "node 10.0.0.12 (host-2; engine-0): does not see the driver's files there" in message
    assert "10.0.0.11" not in message
    assert "run_dir=/mnt/shared/runs/NAME" in message
    assert isinstance(caught.value, ConfigError)  # the CLI prints it as `rlsys: error:` with exit code 2


def test_a_relative_run_dir_under_ray_job_submit_is_explained():
    job_dir = __import__("pathlib").Path("/tmp/ray/session_x/runtime_resources/working_dir_files/_ray_pkg_1/runs/a")
    with pytest.raises(NodeCheckFailed, match="relative run_dir resolves inside each node's own copy"):
        refuse_unusable_nodes([_report("10.0.0.11", ["engine-0"], run_dir_problem="x")], job_dir, ("/m",))


def test_a_node_without_the_model_is_named():
    reports = [_report("10.0.0.11", ["trainer rank 0"], model_problem="/m has no config.json on this node")]
    with pytest.raises(NodeCheckFailed, match=r"node 10.0.0.11 \(host-1; trainer rank 0\): /m has no config.json"):
        refuse_unusable_nodes(reports, __import__("pathlib").Path("/shared/run"), ("/m",))


def test_the_memory_budget_is_the_nodes_devices_never_the_drivers():
    reports = [_report("10.0.0.11", ["trainer rank 0"], gpu=80 * GB), _report("10.0.0.12", ["engine-0"], gpu=40 * GB)]
    budget, source = device_memory_budget(reports, has_gpu=True)
    assert budget == 40 * GB and "10.0.0.12" in source
    cpu_budget, source = device_memory_budget([_report("10.0.0.11", ["x"], ram=8 * GB),
                                               _report("10.0.0.12", ["y"], ram=16 * GB)], has_gpu=False)
    assert cpu_budget == 8 * GB and "RAM of node 10.0.0.11" in source
    with pytest.raises(NodeCheckFailed, match="set placement.gpu_memory_gb"):
        device_memory_budget([_report("10.0.0.11", ["x"])], has_gpu=True)


def test_custom_node_resources_go_into_the_bundles(tiny_model_dir):
    tree = {"model": {"path": str(tiny_model_dir)}, "data": {"synthetic": {"task": "max_digit"}},
            "trainer": {"num_ranks": 2}, "rollout": {"num_engines": 1},
            "placement": {"mode": "disaggregated", "trainer_node_resources": {"train_node": 1},
                          "engine_node_resources": {"rollout_node": 0.5}}}
    topology = Topology.from_config(RunConfig.model_validate(tree), has_gpu=False)
    assert topology.bundles() == [{"CPU": 1, "train_node": 1}, {"CPU": 1, "train_node": 1},
                                  {"CPU": 1, "rollout_node": 0.5}]
    assert topology.custom_resources() == {"train_node": 2, "rollout_node": 0.5}
    tree["placement"]["mode"] = "colocated"
    colocated = Topology.from_config(RunConfig.model_validate(tree), has_gpu=False)
    assert colocated.bundles() == [{"CPU": 2, "train_node": 1, "rollout_node": 0.5}] * 2
    assert colocated.roles_by_bundle() == {0: ["trainer rank 0", "engine-0"], 1: ["trainer rank 1"]}


def test_node_resources_must_be_custom_and_positive(tiny_model_dir):
    from pydantic import ValidationError

    base = {"model": {"path": str(tiny_model_dir)}, "data": {"synthetic": {"task": "max_digit"}}}
    with pytest.raises(ValidationError, match="GPU is set by the placement itself"):
        RunConfig.model_validate({**base, "placement": {"engine_node_resources": {"GPU": 1}}})
    with pytest.raises(ValidationError, match="must be > 0"):
        RunConfig.model_validate({**base, "placement": {"trainer_node_resources": {"train_node": 0}}})


def test_gloo_binds_to_the_interface_that_holds_the_node_address(monkeypatch):
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    assert interface_with_address("127.0.0.1") == "lo"
    assert gloo_interface_env("127.0.0.1", {}) == {GLOO_INTERFACE_ENV: "lo"}
    assert gloo_interface_env("127.0.0.1", {GLOO_INTERFACE_ENV: "ib0"}) == {}  # the user's choice stands
    assert gloo_interface_env("203.0.113.77", {}) == {}  # an address no interface holds: gloo's own choice


def test_engines_listen_on_the_address_given_and_require_their_key(tiny_model_dir, monkeypatch):
    from rlsys.config import EngineConfig, ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec, SGLangServer, build_command, build_env
    from rlsys.system.backend import make_backend

    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)  # an in-process trainer of another test may have set it
    spec = ServerSpec(ModelConfig(path=str(tiny_model_dir)))
    server = SGLangServer(spec, make_backend(False), "engine-0", "/tmp/unused.log", host="127.0.0.1")
    command = build_command(spec, make_backend(False), "127.0.0.1", server.port, server.api_key)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert f"--api-key={server.api_key}" in command and server.api_key == server.address.api_key
    assert server.api_key not in repr(server.address) and server.api_key not in str(server.address)
    assert build_env(spec, make_backend(False), "127.0.0.1")[GLOO_INTERFACE_ENV] == "lo"
    # a key the user set in extra_args is the one used, and not passed twice
    own = ServerSpec(ModelConfig(path=str(tiny_model_dir)), EngineConfig(extra_args=["--api-key", "mine"]))
    own_server = SGLangServer(own, make_backend(False), "engine-1", "/tmp/unused.log")
    assert own_server.api_key == "mine"
    assert build_command(own, make_backend(False), "127.0.0.1", 1, own_server.api_key).count("--api-key") == 1
    assert not any(arg.startswith("--api-key=") for arg in build_command(own, make_backend(False), "127.0.0.1", 1,
                                                                          own_server.api_key))


def test_the_client_sends_the_engines_key():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlsys.rollout.sglang.client import EngineAddress, EngineError, SGLangClient

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == "Bearer sesame"
            body = json.dumps({"weight_version": "3"} if ok else {"error": "unauthorized"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert SGLangClient(EngineAddress("engine-0", url, api_key="sesame")).model_info()["weight_version"] == "3"
        with pytest.raises(EngineError, match="HTTP 401"):
            SGLangClient(EngineAddress("engine-0", url)).model_info()
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_engine_is_named_with_its_address():
    from rlsys.rollout.sglang.client import EngineAddress, EngineError, SGLangClient

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens here
    with pytest.raises(EngineError, match=rf"engine-3 \({url}\): /model_info failed: could not be reached at {url}"):
        SGLangClient(EngineAddress("engine-3", url), timeout_s=5).model_info()


def test_an_engine_a_trainer_rank_cannot_reach_is_reported_at_connect_time_naming_both_nodes():
    from rlsys.rollout.sglang.client import EngineAddress, EngineUnreachable, SGLangClient, check_reachable

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens here
    with pytest.raises(EngineUnreachable) as caught:
        check_reachable(SGLangClient(EngineAddress("engine-1", url)), "trainer rank 0 on node 10.0.0.11", timeout_s=5)
    message = str(caught.value)
    assert f"engine-1 ({url}): /model_info failed: trainer rank 0 on node 10.0.0.11 cannot reach it" in message
    assert "(node 127.0.0.1)" in message and "nodes must reach each other's addresses" in message


def test_a_key_that_begins_with_a_dash_reaches_sglang_as_the_key(tiny_model_dir):
    """secrets.token_urlsafe starts with '-' once in 64 keys; passed as `--api-key -x...` argparse takes
    it for an option and SGLang refuses to start ("expected one argument")."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from rlsys.config import ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec, build_command
    from rlsys.system.backend import make_backend

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    command = build_command(ServerSpec(ModelConfig(path=str(tiny_model_dir))), make_backend(False), "127.0.0.1", 1,
                            "-Xk_3")
    arguments = command[command.index("sglang.launch_server") + 1:]
    assert parser.parse_args(arguments).api_key == "-Xk_3"


def test_the_doctor_given_an_address_where_no_cluster_listens_says_so_at_once_as_a_blocker(capsys):
    """`rlsys doctor --address HOST:PORT --json` with nothing listening there: ray.init would retry for
    minutes; the doctor's report is one JSON document whose blocker names the address, exit 1."""
    import json
    import time

    from rlsys.cli import main
    from rlsys.system.cluster import unreachable

    with socket.socket() as sock:  # a port nothing listens on once this closes
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    assert unreachable(address) == "Connection refused"
    assert unreachable("auto") is None and unreachable("ray://head:10001") is None
    start = time.monotonic()
    assert main(["doctor", "--address", address, "--json"]) == 1
    assert time.monotonic() - start < 30  # the connection is refused at once; 30 s: a loaded machine
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["nodes"] == []
    (blocker,) = report["problems"]
    assert blocker["severity"] == "blocker" and f"no Ray cluster at '{address}': Connection refused" in blocker["what"]


def test_rays_token_authentication_notice_is_kept_off_the_terminal_but_its_errors_are_not():
    """Every `rlsys engines` command and attached run printed Ray's WARNING that token authentication
    is on; the logger quieted is the one Ray's module writes it with."""
    import logging

    from ray._private.authentication import authentication_token_setup

    from rlsys.system.cluster import ray_auth_notice_quiet

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    authentication_token_setup.logger.addHandler(handler)  # Ray's loggers do not propagate to the root
    try:
        with ray_auth_notice_quiet():
            authentication_token_setup.logger.warning("Token authentication is enabled for this Ray cluster.")
            authentication_token_setup.logger.error("the token is wrong")
        authentication_token_setup.logger.warning("outside")
    finally:
        authentication_token_setup.logger.removeHandler(handler)
    assert seen == ["the token is wrong", "outside"]

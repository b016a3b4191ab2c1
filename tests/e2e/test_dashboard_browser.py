"""The dashboard as a person sees it: headless Chromium against a live run."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import REPO, served_run_dir

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"
CHARTS = ["chart-reward", "chart-kl", "chart-loss", "chart-entropy", "chart-response-len",
          "chart-tokens-per-s", "chart-mismatch", "chart-sync", "chart-sync-bytes", "chart-sampling",
          "chart-truncation", "chart-policy", "chart-tis", "chart-tools", "chart-staleness", "chart-partial",
          "chart-memory"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())


def _post(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, method="POST", data=b"",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def _chromium(*args: str) -> str:
    profile = tempfile.mkdtemp(prefix="rlsys-chromium-")
    try:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1400,1500", "--virtual-time-budget=6000", *args],
            capture_output=True, text=True, timeout=120,
        ).stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (make test installs it)")
def test_dashboard_shows_a_live_run(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    assert CHROMIUM, "CI must have Debian's chromium: `make test` installs it with apt-get"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # a named eval set (eval.datasets) gets a chart of its own
    (tmp_path / "held_out.jsonl").write_text("".join(f'{{"prompt": "{d} {d + 1} {d + 2}>", "label": "{d + 2}"}}\n'
                                                     for d in range(7)))
    eval_set = f"eval.datasets=[{{name: held_out, path: {tmp_path / 'held_out.jsonl'}, n_samples: 2, " \
               "temperature: 1.0, pass_k: [2]}]"
    run = subprocess.Popen(
        [sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs/quickstart.yaml"),
         f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "logging.progress_bar=false",
         "trainer.total_steps=400", "eval.interval=5", f"status.port={port}", "status.token=let-me-in", eval_set,
         ray_address, quickstart_engines],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RLSYS_STATUS_TOKEN": ""},
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert run.poll() is None, run.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never finished 6 steps"
            try:
                status = _get(f"{url}/api/v1/status")
                if status["step"] >= 6:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert status["state"] in ("rollout", "training", "syncing", "evaluating")

        before = _get(f"{url}/api/v1/status")["step"]
        dom = _chromium("--dump-dom", f"{url}/")
        after = _get(f"{url}/api/v1/status")["step"]
        assert 'data-loaded="true"' in dom, dom[:2000]
        for chart in CHARTS:
            points = int(re.search(rf'id="{chart}"[^>]*data-points="(\d+)"', dom).group(1))
            assert before <= points <= after, f"{chart}: {points} points for {before}..{after} finished steps"
        eval_chart = re.search(r'<div class="chart" id="chart-eval-held_out"[^>]*>', dom)
        assert eval_chart and 'data-eval-set="held_out"' in eval_chart.group(0), dom[:2000]
        assert before <= int(re.search(r'data-points="(\d+)"', eval_chart.group(0)).group(1)) <= after
        assert "pass@2" in dom and "eval set held_out" in dom  # its legend and title
        assert len(re.findall(r'class="tl-row" data-step=', dom)) >= before  # a timeline row per step
        assert 'data-phase="generate"' in dom and 'data-phase="train"' in dom and 'data-phase="sync"' in dom
        assert len(re.findall(r'<tr data-kind="trainer">', dom)) == 2
        assert len(re.findall(r'<tr data-kind="engine">', dom)) == 1
        assert re.search(r'id="weight-version">\d+<', dom)

        ARTIFACTS.mkdir(exist_ok=True)
        _chromium(f"--screenshot={ARTIFACTS / 'dashboard.png'}", f"{url}/")
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000

        # the plots grow as steps finish
        time.sleep(3)
        later = int(re.search(r'id="chart-reward"[^>]*data-points="(\d+)"', _chromium("--dump-dom", f"{url}/")).group(1))
        assert later > before

        assert _post(f"{url}/api/v1/stop", None) == 401
        assert _post(f"{url}/api/v1/stop", "let-me-in") == 200
        run.wait(timeout=120)
        assert run.returncode == 0, run.stderr.read()[-3000:]
        assert json.loads(Path(tmp_path / "run" / "status.json").read_text())["state"] == "stopped"
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (make test installs it)")
def test_dashboard_renders_server_strings_as_text(tmp_path):
    """A Ray error (or any string from the server) holding markup is shown, never interpreted."""
    from rlsys.observability.status.state import ActorHealth, RunStatus

    status = RunStatus(run_id="markup", total_steps=3, run_dir=str(tmp_path))
    status.record_step({"step": 0, "reward_mean": 0.5, "time_step_s": 1.0, "synced_weight_version": 1})
    status.set_actors([ActorHealth("engine-0", "engine", False, None, None,
                                   '<img id="injected" src="x" onerror="document.title=\'owned\'">')])
    status.fail("<b id='bold-error'>RayActorError</b>")
    status.save_snapshot()
    (tmp_path / "metrics.jsonl").write_text(json.dumps(status.metrics_since(0)[0]) + "\n")
    with served_run_dir(tmp_path) as url:
        dom = _chromium("--dump-dom", f"{url}/")
        assert 'data-loaded="true"' in dom, dom[:2000]
        assert "&lt;img id=\"injected\"" in dom and 'id="injected"' not in dom.replace("&lt;img id=\"injected\"", "")
        assert "&lt;b id='bold-error'&gt;" in dom or "&lt;b id=\"bold-error\"&gt;" in dom
        assert "<title>owned</title>" not in dom

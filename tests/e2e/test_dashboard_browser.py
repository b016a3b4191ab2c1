"""The dashboard as a person sees it: headless Chromium against a live run."""

import json
import os
import re
import shutil
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


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (make test installs it)")
def test_dashboard_shows_a_live_run(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    assert CHROMIUM, "CI must have Debian's chromium: `make test` installs it with apt-get"
    # a named eval set (eval.datasets) gets a chart of its own
    (tmp_path / "held_out.jsonl").write_text("".join(f'{{"prompt": "{d} {d + 1} {d + 2}>", "label": "{d + 2}"}}\n'
                                                     for d in range(7)))
    eval_set = f"eval.datasets=[{{name: held_out, path: {tmp_path / 'held_out.jsonl'}, n_samples: 2, " \
               "temperature: 1.0, pass_k: [2]}]"
    run = subprocess.Popen(
        [sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs/quickstart.yaml"),
         f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "logging.progress_bar=false",
         "trainer.total_steps=400", "eval.interval=5", "status.port=0", "status.token=let-me-in", eval_set,
         ray_address, quickstart_engines],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RLSYS_STATUS_TOKEN": ""},
    )
    try:
        deadline = time.monotonic() + 600
        url = None  # the server picks its port (status.port=0) and the run's status.json says which
        while True:
            assert run.poll() is None, run.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never finished 6 steps"
            try:
                url = url or json.loads((tmp_path / "run" / "status.json").read_text()).get("status_url")
                status = _get(f"{url}/api/v1/status") if url else {"step": -1}
                if status["step"] >= 6:
                    break
            except (OSError, ValueError):  # no status.json yet, or its server not answering yet
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
        timeline_steps = [int(step) for step in re.findall(r'class="tl-row[^"]*" data-step="(\d+)"', dom)]
        assert timeline_steps == sorted(timeline_steps, reverse=True)  # newest first: it opens on the latest
        # the legends rest on the latest step; an eval series shows its latest value there, not "–"
        start = dom.index('id="chart-reward"')
        reward_chart = dom[start:dom.index('<div class="chart"', start)]
        legend_values = re.findall(r'class="u-value"[^>]*>([^<]*)<', reward_chart)
        assert legend_values and "–" not in legend_values, legend_values
        assert 'data-phase="generate"' in dom and 'data-phase="train"' in dom and 'data-phase="sync"' in dom
        assert len(re.findall(r'<tr data-kind="trainer">', dom)) == 2
        assert len(re.findall(r'<tr data-kind="engine">', dom)) == 1
        assert re.search(r'id="weight-version">\d+<', dom)
        # the latest answers, as text: the step's (4 a step) and the latest eval's (every 5 steps: within the 40 shown)
        assert int(re.search(r'<table id="samples"[^>]*data-rows="(\d+)"', dom).group(1)) == 40
        assert 'data-source="train"' in dom and 'data-source="eval:held_out"' in dom and 'data-source="eval"' in dom
        assert re.search(r'<td class="sample-text">\d \d \d&gt;</td>', dom), "a quickstart prompt, as text"

        ARTIFACTS.mkdir(exist_ok=True)
        _chromium(f"--screenshot={ARTIFACTS / 'dashboard.png'}", f"{url}/")
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000

        # the plots grow as steps finish
        time.sleep(3)
        later = int(re.search(r'id="chart-reward"[^>]*data-points="(\d+)"', _chromium("--dump-dom", f"{url}/")).group(1))
        assert later > before

        # every process's stacks on demand, through the status API: refused without the token
        stacks = [sys.executable, "-m", "rlsys.cli", "stacks", str(tmp_path / "run")]
        quiet_env = {**os.environ, "RLSYS_STATUS_TOKEN": ""}
        refused = subprocess.run(stacks, capture_output=True, text=True, timeout=120, env=quiet_env)
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr and "--token" in refused.stderr
        dumped = subprocess.run([*stacks, "--token", "let-me-in", "--json"], capture_output=True, text=True,
                                timeout=180, env=quiet_env)
        assert dumped.returncode == 0, dumped.stderr[-3000:]
        dump = json.loads(dumped.stdout)
        roles = [process["role"] for process in dump["processes"]]
        assert roles[:4] == ["driver", "trainer rank 0", "trainer rank 1", "engine-0"], roles
        assert any(role.startswith("engine-0 sglang::scheduler") for role in roles), roles
        assert all("Thread" in process["stacks"] for process in dump["processes"]), dump["processes"]
        assert (Path(dump["directory"]) / "summary.json").exists()
        time.sleep(3)  # the dashboard polls every 2 s: it now links the dump
        hang_link = re.search(r'<div id="latest-hang"[^>]*>.*?</div>', _chromium("--dump-dom", f"{url}/"), re.S)
        assert hang_link and "hidden" not in hang_link.group(0).split(">")[0] and dump["directory"] in hang_link.group(0)

        assert _post(f"{url}/api/v1/stop", None) == 401
        assert _post(f"{url}/api/v1/stop", "let-me-in") == 200
        run.wait(timeout=120)
        assert run.returncode == 0, run.stderr.read()[-3000:]
        assert json.loads(Path(tmp_path / "run" / "status.json").read_text())["state"] == "stopped"
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)


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


OFF_IN_THIS_RUN = ["chart-sampling", "chart-tis", "chart-tools", "chart-staleness", "chart-partial"]


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="Debian's chromium is not installed (make test installs it)")
def test_a_finished_runs_dashboard_hides_what_is_off_and_shows_the_latest_values(tmp_path):
    """A finished quickstart-like run (no dynamic sampling, corrections, tools, staleness or partial rollouts;
    KL 0 throughout): the charts of the features that are off are hidden, not empty boxes, and a
    note names them; the flat KL sits on a narrow axis around 0, not 0..100; each legend shows the
    last step's value without hovering; the header has the latest reward and eval; actors stopped
    with the run are not shown as failures."""
    from rlsys.observability.status.state import ActorHealth, RunStatus

    status = RunStatus(run_id="finished", total_steps=6, run_dir=str(tmp_path))
    for step in range(6):
        status.record_step({"step": step, "reward_mean": 0.25 + 0.1 * step, "kl": 0.0, "loss": 0.01 * step,
                            "clip_fraction": 0.0, "entropy": 2.0, "response_len_mean": 2.0, "time_step_s": 0.4,
                            "time_generate_s": 0.2, "time_train_s": 0.1, "time_sync_s": 0.1, "truncated_fraction": 1.0,
                            "synced_weight_version": step + 1,
                            **({"eval_reward_mean": 0.1 * step} if step % 2 == 0 or step == 5 else {})})
    status.set_actors([ActorHealth("trainer-rank-0", "trainer", False, None, None, ""),
                       ActorHealth("engine-0", "engine", False, None, None, "")])
    status.set_state("finished")
    status.save_snapshot()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in status.metrics_since(0)))
    with served_run_dir(tmp_path) as url:
        dom = _chromium("--dump-dom", f"{url}/")
    assert 'data-loaded="true"' in dom, dom[:2000]
    charts = {m.group(1): m.group(0) for m in re.finditer(r'<div class="chart" id="(chart-[a-z-]+)"[^>]*>', dom)}
    for chart in OFF_IN_THIS_RUN:
        assert " hidden" in charts[chart], charts[chart]
    for chart in ("chart-reward", "chart-kl", "chart-loss", "chart-truncation", "chart-policy"):
        assert " hidden" not in charts[chart], charts[chart]
    note = re.search(r'<p id="charts-off">([^<]*)</p>', dom).group(1)
    assert note.startswith("Not shown, no data in this run (the feature is off): ")
    for title in ("dynamic sampling", "rollout corrections", "multi-turn", "asynchronous training",
                  "partial rollouts"):
        assert title in note, note
    assert "reward (train, eval)" not in note and "KL to reference" not in note
    y_min, y_max = (float(v) for v in re.search(r'data-y-range="([^"]+)"', charts["chart-kl"]).group(1).split(","))
    assert y_min < 0 < y_max <= 1  # a narrow axis around the flat 0
    kl_legend = dom[dom.index('id="chart-kl"'):dom.index('id="chart-loss"')]
    assert re.search(r'class="u-value">0<', kl_legend), kl_legend[-1500:]
    reward_legend = dom[dom.index('id="chart-reward"'):dom.index('id="chart-kl"')]
    assert re.search(r'class="u-value">0\.75<', reward_legend) and re.search(r'class="u-value">0\.5<', reward_legend)
    loss_legend = dom[dom.index('id="chart-loss"'):dom.index('id="chart-entropy"')]
    assert re.search(r'class="u-value">0\.05<', loss_legend)
    assert re.search(r'id="reward">0\.75<', dom) and re.search(r'id="eval-reward">0\.5<', dom)
    assert dom.count("stopped (run finished)") == 2 and 'class="dead"' not in dom

"""docs/bring-your-own-task.md's walk-through, run literally: its bash blocks, in order, in an
empty directory with .venv/bin first on PATH."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def walkthrough_script() -> str:
    page = (REPO / "docs/bring-your-own-task.md").read_text()
    section = page.split("<!-- byo-task:begin -->", 1)[1].split("<!-- byo-task:end -->", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 5, "the walk-through's five steps"
    return "set -euo pipefail\n" + "\n".join(blocks)


def test_the_byo_task_walkthrough_runs_as_written(leftovers, tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", "-c", walkthrough_script()], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert "dashboard at http://127.0.0.1:8470/" in out
    # 300 rows, 30 held out; train loses any row whose prompt is also in eval
    assert re.search(r"rlsys: data: 2[4-7]\d train and 30 eval prompts", out), out[:2000]
    assert re.search(r"my-task\s*│\s*finished\s*│\s*12 / 12", out), out[-2000:]
    assert (tmp_path / "runs/my-task/hf/model.safetensors").is_file()
    assert int(out.strip().splitlines()[-1]) > 0  # the exported model loads in transformers
    assert any((tmp_path / "runs/my-task/tensorboard").iterdir())
    assert leftovers.processes() == []

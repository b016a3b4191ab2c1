#!/usr/bin/env bash
# One-GPU smoke run of the real GPU path: colocated quickstart with SGLang's memory saver, bf16,
# flash-attn (when the `gpu` extra is installed), CUDA IPC weight sync verified every step.
# Run from the repository root on a CUDA host after `make install-gpu` (or in the deploy/Dockerfile
# image, whose virtualenv is /opt/venv on PATH):
#     bash deploy/gpu_smoke.sh            # prints a summary; exit code 0 when every check holds
set -euo pipefail
cd "$(dirname "$0")/.."
# $PYTHON, else the repository's .venv (make install-gpu), else the python on PATH (the image's).
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY="$(command -v python3 || command -v python)"
fi
RUN_DIR="${RUN_DIR:-runs/gpu-smoke-$(date +%Y%m%d-%H%M%S)}"
# A random ~95 M-parameter model (24 layers, hidden 1024, 256-wide heads; ~0.2 GB in bf16, ~1.5 GB of
# fp32 weights, gradients and Adam state in the trainer). The engine check compares what its release
# freed with the weights and KV cache it reports (rlsys/run/handoff.py), not with the GPU's total.
MODEL_DIR="${MODEL_DIR:-.cache/smoke-model}"

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_smoke: no CUDA device visible')"
[ -f "$MODEL_DIR/config.json" ] || "$PY" -m rlsys.cli make-tiny-model "$MODEL_DIR" --hidden-size 1024 --num-layers 24

"$PY" -m rlsys.cli plan configs/quickstart.yaml "model.path=$MODEL_DIR" trainer.num_ranks=1 \
    model.dtype=bfloat16 placement.device=cuda
"$PY" -m rlsys.cli train configs/quickstart.yaml "model.path=$MODEL_DIR" "run_dir=$RUN_DIR" \
    placement.device=cuda placement.mode=colocated trainer.num_ranks=1 rollout.num_engines=1 \
    model.dtype=bfloat16 trainer.total_steps=20 eval.interval=10 weight_sync.verify=true \
    logging.progress_bar=false status.port=0

"$PY" - "$RUN_DIR" <<'PYEOF'
import json, sys
from pathlib import Path

from rlsys.run.handoff import ENGINE_RELEASE_SHARE, engine_gave_memory_back, trainer_gave_memory_back

run_dir = Path(sys.argv[1])
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
gib = lambda b: f"{(b or 0) / 2**30:.2f} GiB"
last = rows[-1]
print(f"gpu_smoke: {len(rows)} steps, weight versions {rows[0]['weight_version']}..{last['weight_version']}")
print(f"gpu_smoke: logprob_mismatch max {max(r['logprob_mismatch'] for r in rows):.4f} (bf16: expect < 0.05)")
# Engine figures are the GPU's memory in use, device-wide (NVML; a per-process figure is 0 in
# containers): serving = before the engine's release, released = after it, the trainer asleep both
# times; the CUDA contexts and workspaces stay in both, so the release must free ENGINE_RELEASE_SHARE
# of the weights + KV cache the engine reports.
print(f"gpu_smoke: engine serving {gib(last['memory_engine_serving_bytes'])}, "
      f"released {gib(last['memory_engine_released_bytes'])} (GPU memory in use); "
      f"weights + KV cache {gib(last.get('memory_engine_releasable_bytes'))}, must free "
      f">= {ENGINE_RELEASE_SHARE:g} of it")
print(f"gpu_smoke: trainer awake {gib(last['memory_trainer_awake_bytes'])}, "
      f"asleep {gib(last['memory_trainer_asleep_bytes'])}")
checks = {
    "weights synced every step": [r["weight_version"] for r in rows] == list(range(len(rows))),
    "engine logprobs match the trainer (bf16)": max(r["logprob_mismatch"] for r in rows) < 0.05,
    "engine gives its weights and KV cache back while the trainer trains": all(map(engine_gave_memory_back, rows)),
    "trainer gives memory back while the engine generates": all(map(trainer_gave_memory_back, rows)),
}
for name, ok in checks.items():
    print(f"gpu_smoke: {'ok  ' if ok else 'FAIL'} {name}")
sys.exit(0 if all(checks.values()) else 1)
PYEOF

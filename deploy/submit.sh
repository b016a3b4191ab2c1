#!/usr/bin/env bash
# Submit an rlsys GRPO run to a Ray cluster:
#   deploy/submit.sh [--address http://HEAD:8265] CONFIG [section.field=value ...]
# The repository is uploaded as the job's working directory (without the virtualenv, caches and
# run outputs); the coordinator then connects to the cluster it runs in (RAY_ADDRESS).
# Ray 2.60 enables token auth once ~/.ray/auth_token exists: export RAY_AUTH_TOKEN_PATH to the
# cluster's token file, or RAY_AUTH_MODE=disabled on a private loopback cluster.
set -euo pipefail
address="${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}"
if [[ "${1:-}" == "--address" ]]; then
  address="$2"
  shift 2
fi
if [[ $# -lt 1 ]]; then
  echo "usage: deploy/submit.sh [--address http://HEAD:8265] CONFIG [overrides...]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
exec ray job submit \
  --address "$address" \
  --working-dir . \
  --runtime-env-json '{"excludes": [".venv", ".cache", "runs", ".git", "test-artifacts", "**/__pycache__"], "env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}' \
  -- python -m rlsys.cli train "$@"

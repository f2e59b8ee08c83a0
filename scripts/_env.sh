# Sourced by scripts/demo.sh and scripts/test.sh: make sure ./.venv exists and is up to date.
#
# Idempotent: the environment is (re)built only when it is missing or when pyproject.toml or
# constraints.txt changed since it was built. torch is pinned to 2.13.0 (its CPU build is on
# these machines' disk); everything else resolves through the committed constraints.txt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "setting up $VENV (once) ..." >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      -c "$ROOT/constraints.txt" -e "$ROOT[dev,wandb,plot,cli,docs]"
  echo "$stamp" > "$VENV/.stamp"
fi
export PATH="$VENV/bin:$PATH"
export WANDB_MODE="${WANDB_MODE:-offline}"
export TOKENIZERS_PARALLELISM=false
export NO_MKDOCS_2_WARNING=1
cd "$ROOT"

# Sourced by scripts/demo.sh and scripts/test.sh: make sure the virtual environment of the chosen
# combination exists and is up to date, and put it first on PATH.
#
# Two supported combinations, each pinned by its constraints file:
#   PYTHON=python3.12 (default): megatron-core 0.19, transformers 5   -> .venv-py3.12, constraints-py3.12.txt
#   PYTHON=python3.11:           megatron-core 0.16, transformers 4   -> .venv-py3.11, constraints-py3.11.txt
# torch is 2.13.0 on both: on Python 3.11 its CPU build lies on these machines' disk; on Python
# 3.12 pip takes the registry's CUDA build (~5.5 GB, about 4 minutes on 2 cores, measured
# 2026-11-28; it runs on CPU too).
# Idempotent: an environment is (re)built only when it is missing or when what it was built from
# (the Python version, pyproject.toml, the constraints file) changed since.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.12}"
if ! "$PY" -c '' >/dev/null 2>&1; then
  # pyenv installs every version but puts only one on PATH (the others' shims refuse to run).
  found="$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"${PY#python}"*/bin/"$PY" 2>/dev/null | tail -1 || true)"
  if [ -z "$found" ]; then
    echo "error: PYTHON=$PY was not found; install it (e.g. pyenv install ${PY#python}) or pass PYTHON=python3.11" >&2
    exit 2
  fi
  PY="$found"
fi
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
CONSTRAINTS="$ROOT/constraints-py$PYVER.txt"
if [ ! -f "$CONSTRAINTS" ]; then
  echo "error: no pinned combination for Python $PYVER ($CONSTRAINTS); use PYTHON=python3.12 or PYTHON=python3.11" >&2
  exit 2
fi
VENV="$ROOT/.venv-py$PYVER"
stamp="$( (echo "$PYVER"; cat "$ROOT/pyproject.toml" "$CONSTRAINTS") | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$stamp" ]; then
  started=$SECONDS
  if [ "$PYVER" = "3.11" ]; then torch_note="its CPU build, from this machine's disk when there"
  else torch_note="its CUDA build from the registry, about 4 GB: the longest step"; fi
  echo "setting up $VENV (Python $PYVER, once: 5.5 GB and about 4 minutes on a 2-core machine with Python 3.12, 1.8 GB with 3.11):" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  echo "  [1/2] torch ($torch_note) ..." >&2
  # pip's own progress bars while it downloads (quiet would say nothing for minutes).
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
      -c "$CONSTRAINTS" torch 2>&1 | { grep -v '^Requirement already satisfied' || true; } >&2
  echo "  [2/2] megatron-core, lightning, transformers, mbridge and the test tools ..." >&2
  # The build backend's notes about editable installs go to a log, shown if the install fails.
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      -c "$CONSTRAINTS" -e "$ROOT[dev,wandb,plot,cli,docs,peft,s3]" 2> "$VENV/install.log"; then
    cat "$VENV/install.log" >&2
    exit 1
  fi
  echo "$stamp" > "$VENV/.stamp"
  echo "  done in $(( SECONDS - started )) s: $(du -sh "$VENV" | cut -f1) in $VENV" >&2
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
export WANDB_MODE="${WANDB_MODE:-offline}"
export TOKENIZERS_PARALLELISM=false
export NO_MKDOCS_2_WARNING=1
cd "$ROOT"

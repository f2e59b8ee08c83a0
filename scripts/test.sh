#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (unit, distributed on CPU/gloo; gpu tier skips
# itself without CUDA). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check .
ruff format --check .
mypy
python -m pytest "$@"

#!/usr/bin/env bash
# Lint, type-check, build the docs site (strict) and run the whole test suite (unit,
# distributed and faults on CPU/gloo, examples; the gpu tier skips itself without CUDA).
# Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check .
ruff format --check .
mypy
mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
python -m pytest "$@"

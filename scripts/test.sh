#!/usr/bin/env bash
# Lint, type-check, build the docs site (strict) and run the whole test suite (unit,
# distributed and faults on CPU/gloo, examples, packaging; the gpu tier skips itself without
# CUDA). PYTHON=python3.11 selects the other supported combination (scripts/_env.sh). Where the
# other combination's environment exists, the cross-version test runs against it.
# Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
for other in "$ROOT"/.venv-py3.1[12]; do
  if [ "$other" != "$VENV" ] && [ -x "$other/bin/python" ] && [ -z "${LMC_OTHER_PYTHON:-}" ]; then
    export LMC_OTHER_PYTHON="$other/bin/python"
  fi
done
# The lint, type, import-contract and docs checks run beside the tests, not before them: mypy
# alone takes about a minute of one core from a cold cache, while the tests keep both cores
# busy. Their output is shown, and their failure fails the run, once the tests have ended.
checks_log="$(mktemp)"
(
  set -e
  ruff check .
  ruff format --check .
  mypy
  lint-imports
  mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
) > "$checks_log" 2>&1 &
checks=$!
# This package's bytecode, as pip writes it for every installed package: the tests start
# hundreds of interpreters and ranks, and where PYTHONDONTWRITEBYTECODE is set (as in many CI
# images) each would otherwise compile the package from source again.
python -m compileall -q -j 0 lightning_mcore_ckpt tests benchmarks examples >/dev/null
# Three test files at a time on 2 cores (LMC_TEST_WORKERS; 0: one process): most tests wait on
# their ranks, files, fsyncs and subprocesses more than they compute (two workers kept the
# cores about 55% busy). A file's tests stay in one worker, so a module's shared runs are made
# once.
tests=0
python -m pytest -n "${LMC_TEST_WORKERS:-3}" --dist loadfile --durations=20 "$@" || tests=$?
lint=0
wait "$checks" || lint=$?
if [ "$lint" -ne 0 ]; then
  echo "FAILED: the lint, type, import-contract or docs checks (exit $lint):" >&2
  cat "$checks_log" >&2
elif [ -s "$checks_log" ]; then
  cat "$checks_log"
fi
rm -f "$checks_log"
[ "$tests" -eq 0 ] && [ "$lint" -eq 0 ] || exit $(( tests != 0 ? tests : lint ))

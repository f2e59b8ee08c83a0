#!/usr/bin/env bash
# The GPU tier and the GPU benchmark on a machine with one CUDA GPU (docs/gpu.md, "The GPU test
# tier"). For a GPU machine without a package registry: wheels of what it lacks (megatron-core,
# mbridge, torchdata, nvidia-resiliency-ext) in ./.whl are installed first (docs/testing.md says
# how to download them). Results go to $OUT (default ./gpu-results), written as they come, so
# that a run cut short still leaves what it measured:
#   environment.txt   nvidia-smi, versions
#   gpu-tier.log/.xml tests/gpu (one GPU: the one-GPU cells run side by side)
#   bench/            python -m benchmarks --device cuda (JSON and Markdown after each size),
#                     then its cold loads in alternating rounds (--only-loads, 1G; torch
#                     AdamW, then Megatron-Core's distributed optimizer over bf16 weights, then
#                     over fp32 weights: each written as it ends)
# `scripts/gpu-tier.sh tests`, `... bench` or `... loads` runs one part only. TEST_TIMEOUT,
# BENCH_TIMEOUT and LOADS_TIMEOUT (seconds) bound each part; BENCH_ARGS replaces the
# benchmark's arguments (default: --sizes 1G,4G); TEST_WORKERS sets the tier's pytest-xdist
# workers on the one GPU (default 4).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
{
  nvidia-smi
  python3 -c 'import torch, lightning, megatron.core as m; print("torch", torch.__version__,
"cuda", torch.version.cuda, "lightning", lightning.__version__, "megatron-core", m.__version__)'
  python3 -c 'import nvidia_resiliency_ext as n; print("nvidia-resiliency-ext", n.__file__)'
  df -h "$PWD" /tmp
} >"$OUT/environment.txt" 2>&1
part="${1:-all}"
status=0
if [ "$part" = all ] || [ "$part" = tests ]; then
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest tests/gpu tests/distributed/test_launch_cuda.py -n "${TEST_WORKERS:-4}" -q -rA -p no:cacheprovider \
  --junitxml="$OUT/gpu-tier.xml" >"$OUT/gpu-tier.log" 2>&1 || status=1
tail -n 30 "$OUT/gpu-tier.log"
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks --device cuda ${BENCH_ARGS:---sizes 1G,4G} \
  --dir /tmp/lmc-bench --out "$OUT/bench" >"$OUT/bench.log" 2>&1 || status=1
tail -n 60 "$OUT/bench.log"
fi
if [ "$part" = all ] || [ "$part" = loads ]; then
timeout "${LOADS_TIMEOUT:-300}" python3 -m benchmarks --only-loads --device cuda --sizes 1G \
  --procs 1 --repeats 2 --optimizers adamw,distributed-bf16,distributed \
  --dir /tmp/lmc-bench --out "$OUT/bench" >"$OUT/loads.log" 2>&1 || status=1
tail -n 40 "$OUT/loads.log"
fi
exit "$status"

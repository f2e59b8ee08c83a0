#!/usr/bin/env bash
# Save/load benchmarks: this package against the disk's limit, raw Megatron-Core
# dist_checkpointing, torch.save and torch.distributed.checkpoint, measured side by side.
# Writes benchmarks/results/<date>-<host>.{json,md,png}. Extra arguments go to
# `python -m benchmarks` (--quick: seconds; --big: adds the ~4 GiB state; --help).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python -m benchmarks "$@"

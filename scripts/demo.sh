#!/usr/bin/env bash
# The CPU demo: train a tiny Megatron-Core GPT from Hugging Face weights (TP=2, 2 processes),
# get preempted, resume exactly, export to Hugging Face once, list and report the run.
# Extra arguments go to examples/demo.py.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python examples/demo.py "$@"

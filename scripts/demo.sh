#!/usr/bin/env bash
# The CPU demo: a tiny Megatron-Core GPT trained with tensor parallelism 2 on 2 processes,
# checkpointed with lightning-mcore-ckpt. Extra arguments go to examples/demo.py.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python examples/demo.py "$@"

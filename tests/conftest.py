from __future__ import annotations

import os
import sys

# Rank functions import helpers that live next to the tests (e.g. tests/distributed/_trainer.py).
_HERE = os.path.dirname(__file__)
_HELPERS = [
    os.path.join(_HERE, d)
    for d in ("distributed", "faults", "compat", "resume", "export", "storage")
]
sys.path[:0] = _HELPERS
os.environ["PYTHONPATH"] = os.pathsep.join([*_HELPERS, os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("WANDB_MODE", "offline")

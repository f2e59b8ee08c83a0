from __future__ import annotations

import os
import sys

# Rank functions import helpers that live next to the tests (e.g. tests/distributed/_trainer.py).
_HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(_HERE, "distributed"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(_HERE, "distributed"), os.environ.get("PYTHONPATH", "")]
)
os.environ.setdefault("WANDB_MODE", "offline")

"""The ``lightning-mcore-ckpt`` command line, one module per command with the logic it runs:

- ``entry``: the parser, built from the command modules, and the dispatch (``main``).
- ``report``: ``report`` (what every save of a run cost) and ``ls`` (what each step holds).
- ``huggingface``: ``export``, ``import`` and ``verify``, between a step and a Hugging Face
  model directory (the conversion is :mod:`lightning_mcore_ckpt.hf`'s).
- ``diff``: two steps compared tensor by tensor, across layouts.
- ``fsck``: is every step whole and unchanged.
- ``inspect``: will a step load into a layout and a model (metadata only; the model of
  ``--config`` built on the meta device).
- ``check_resume``: does a LightningCLI job resume exactly (:mod:`lightning_mcore_ckpt.resume_check`).
- ``failure``: how a command reports what stops it, and its exit code.

Each command module has ``add_parsers`` (its commands' options, and the function that runs each)
beside its logic. The parser imports every command module, so they import torch, Lightning and
Megatron-Core only where a command runs: ``--help`` stays fast and quiet.
"""

from lightning_mcore_ckpt.cli.entry import main

__all__ = ["main"]

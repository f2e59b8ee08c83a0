"""Import: a Hugging Face directory to a step directory of Megatron-Core weights."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt import _atomic, _parallel, layout
from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._load import load_hf_weights

__all__ = ["import_checkpoint"]


def import_checkpoint(
    hf_model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write a Hugging Face model as a step directory of Megatron-Core weights (``model/``).

    ``prefix`` is the attribute path of the GPT model in the LightningModule that will load it
    (``"model."`` for ``self.model``), as the strategy names checkpoint keys. Runs on one process
    (a single-rank group is created when none exists); the model is held in memory once. The
    step gets a ``metadata.json`` (contents ``["model"]``), so ``fit(ckpt_path=out)`` starts
    from these weights with a fresh optimizer and training state.

    Example::

        import_checkpoint("Qwen2.5-0.5B", "init/qwen", prefix="model.")
        trainer.fit(module, ckpt_path="init/qwen")  # or MegatronStrategy(init_from="init/qwen")
    """
    import torch.distributed as dist

    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(
            f"import: --out {target} exists and is not empty; choose a new directory or pass "
            "--overwrite to replace it"
        )
    if not prefix.endswith(".") and prefix:
        raise ValueError(
            f"import: --prefix {prefix!r} must end with '.' (the LightningModule attribute path "
            "of the GPT model, e.g. 'model.')"
        )
    bridge = HFBridge(hf_model_path, dtype=dtype, argument="import: hf_dir")
    start = time.perf_counter()
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError("import_checkpoint runs on one process (world size 1)")
    created_dist = not dist.is_initialized()
    created_mp = not parallel_state.model_parallel_is_initialized()
    launch_env = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved_env = {k: os.environ.get(k) for k in launch_env}
    if created_mp:
        if created_dist:
            from lightning_mcore_ckpt.testing import find_free_port

            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(find_free_port()),
            )
        _parallel.initialize(backend="gloo")
    try:
        model: Any = bridge.gpt_model()

        def ssd() -> dict[str, Any]:
            return dict(model.sharded_state_dict(prefix=prefix))

        count = load_hf_weights([prefix], bridge.path, ssd)
        from megatron.core import dist_checkpointing

        metadata = {
            "format_version": layout.METADATA_FORMAT_VERSION,
            "global_step": 0,
            "epoch": 0,
            "contents": ["model"],
            "imported_from": str(bridge.path),
            "model_type": bridge.model_type,
            "module_prefix": prefix,
            "dtype": str(bridge.dtype).removeprefix("torch."),
        }
        # An existing `out` is empty or `overwrite` was given (checked above): replace it.
        with _atomic.staged_directory(target, replace=True) as partial:
            (partial / layout.MODEL_DIR).mkdir()
            dist_checkpointing.save(ssd(), str(partial / layout.MODEL_DIR))
            _atomic.write_json(partial / layout.METADATA_FILE, metadata)
    finally:
        if created_mp:
            parallel_state.destroy_model_parallel()
        if created_dist:
            dist.destroy_process_group()
        # A launcher started after this (e.g. Lightning's) must not mistake this process for
        # one of its ranks.
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"tensors": count, "path": str(target), "seconds": time.perf_counter() - start}

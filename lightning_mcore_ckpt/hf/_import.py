"""Import: a Hugging Face directory to a step directory of Megatron-Core weights.

The step is written with Megatron-Core's ``dist_checkpointing.save``, which needs a process
group and Megatron-Core's parallel state: an existing single-process group is used, otherwise a
private one is created for the call (no environment variables, no network address) and torn
down before it returns.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._export import refuse_replacing_inputs
from lightning_mcore_ckpt.hf._load import load_hf_weights
from lightning_mcore_ckpt.storage import atomic as _atomic
from lightning_mcore_ckpt.training import parallel as _parallel

__all__ = ["import_checkpoint"]

log = logging.getLogger(__name__)


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
    (``"model."`` for ``self.model``), as the strategy names checkpoint keys. The model is held
    in memory once. The step gets a ``metadata.json`` (contents ``["model"]``), so
    ``fit(ckpt_path=out)`` starts from these weights with a fresh optimizer and training state.
    ``out`` is written under a temporary sibling name and renamed into place: it appears
    complete or not at all (an existing, empty ``out``, or any with ``overwrite=True``, is
    replaced).

    Runs on one process. Process groups:

    - If ``torch.distributed`` is initialised, its default group is used and must have world
      size 1 (a larger one raises ``RuntimeError`` before anything is written); the save is a
      collective over it, so no other thread may run collectives on it meanwhile. Megatron-Core's
      parallel state is used as it is when initialised; otherwise it is initialised for the call
      (``tensor_model_parallel_size=1``, ...) and destroyed before returning.
    - Otherwise a private single-process gloo group is created on an in-memory store, used, and
      destroyed before returning (also on an error), together with the parallel state it set up:
      afterwards ``torch.distributed.is_initialized()`` is ``False`` again.

    ``os.environ`` is left as it was: this function sets no ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` or ``MASTER_PORT``, so a launcher started later in the same process (e.g.
    Lightning's) does not mistake it for one of its ranks, and the ``NVTE_*`` attention-backend
    variables Megatron-Core's ``GPTModel`` sets when it is built are put back when it returns.

    Example::

        import_checkpoint("/models/Qwen2.5-0.5B", "init/qwen", prefix="model.")
        trainer.fit(module, ckpt_path="init/qwen")  # or MegatronStrategy(init_from="init/qwen")
    """
    target = Path(out).expanduser()
    refuse_replacing_inputs(target, "import", hf_dir=Path(hf_model_path))
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
    with single_process_parallel_state(), megatron_environ_writes_undone():
        from megatron.core import dist_checkpointing

        model: Any = bridge.gpt_model()

        def ssd() -> dict[str, Any]:
            return dict(model.sharded_state_dict(prefix=prefix))

        count = load_hf_weights([prefix], bridge.path, ssd)
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
            _atomic.write_json(partial / markers.METADATA_FILE, metadata)
    return {"tensors": count, "path": str(target), "seconds": time.perf_counter() - start}


@contextmanager
def single_process_parallel_state() -> Iterator[None]:
    """A world-size-1 process group and Megatron-Core parallel state for the block.

    Uses what exists; creates what does not (the group on an in-memory ``HashStore``, without
    reading or writing ``os.environ``) and destroys exactly that when the block ends.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError("import_checkpoint runs on one process (world size 1)")
    created_dist = not dist.is_initialized()
    created_mp = not parallel_state.model_parallel_is_initialized()
    try:
        if created_dist:
            log.debug("import: creating a single-process gloo group")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if created_mp:
            _parallel.initialize(backend="gloo", device_type="cpu")
        yield
    finally:
        if created_mp and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if created_dist and dist.is_initialized():
            dist.destroy_process_group()


_MEGATRON_ENVIRON_PREFIX = "NVTE_"


@contextmanager
def megatron_environ_writes_undone() -> Iterator[None]:
    """Put back the ``NVTE_*`` variables as they were before the block.

    Building a Megatron-Core ``GPTModel`` writes its attention-backend choice into
    ``os.environ`` (``NVTE_FLASH_ATTN``, ``NVTE_FUSED_ATTN``, ``NVTE_UNFUSED_ATTN``) and refuses
    a later model of another backend while they are set. The model built here lives only for the
    call, so its choice must not outlive it.
    """
    before = {k: v for k, v in os.environ.items() if k.startswith(_MEGATRON_ENVIRON_PREFIX)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_MEGATRON_ENVIRON_PREFIX)]:
            if key not in before:
                del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value

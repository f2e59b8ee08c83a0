"""The Hugging Face export of a committed step, on the commit thread (rank 0)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt import layout
from lightning_mcore_ckpt.engine import commit_step

if TYPE_CHECKING:
    from lightning_mcore_ckpt.hf import HFExport

__all__ = ["export_into_committed"]

log = logging.getLogger(__name__)


def export_into_committed(hf_export: HFExport, target: Path) -> dict[str, Any]:
    """Export the committed step ``target`` into its ``huggingface/``; the export's figures.

    The step stays complete throughout: ``huggingface/`` appears by rename, then the step's
    metadata is replaced (durably, atomically) with the export's time and the new files. A step
    whose commit failed is not exported (``{}``). A failed export raises ``RuntimeError``
    saying that the step itself is intact.
    """
    from lightning_mcore_ckpt import hf

    metadata = layout.read_metadata(target)
    if metadata is None:  # its commit failed (reported already): nothing to export
        return {}
    start = time.perf_counter()
    try:
        log.info("exporting %s to Hugging Face format", target)
        hf.export_checkpoint(
            target,
            hf_export.path,
            target / layout.HF_DIR,
            dtype=hf_export.dtype,
            require_complete=False,
            overwrite=True,
            progress=False,
        )
        seconds = time.perf_counter() - start
        metadata["hf_export_time_s"] = seconds
        contents = list(metadata.get("contents") or [])
        if "hf_model" not in contents:
            contents.append("hf_model")
        metadata["contents"] = contents
        # The copy is new (or replaced): its files are hashed afresh at this commit.
        hf_files = f"{layout.HF_DIR}/"
        kept = (metadata.get("hashes") or {}).items()
        metadata["hashes"] = {k: v for k, v in kept if not k.startswith(hf_files)}
        commit_step(target, metadata)
    except Exception as err:
        raise RuntimeError(
            f"the Hugging Face export of {target} failed (the step itself is committed and "
            f"intact; export it again with `lightning-mcore-ckpt export`): "
            f"{type(err).__name__}: {err}"
        ) from err
    log.info("exported %s/%s in %.1fs", target, layout.HF_DIR, seconds)
    # Only the export's figure: the save's own were logged at its commit.
    return {"global_step": metadata["global_step"], "hf_export_time_s": seconds}

"""The Hugging Face export of a committed step, on the commit thread (rank 0)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.storage.seal import seal_step

if TYPE_CHECKING:
    from lightning_mcore_ckpt.hf import HFExport
    from lightning_mcore_ckpt.hf._upload import HubUploader

__all__ = ["export_into_committed", "make_uploader"]

log = logging.getLogger(__name__)


def make_uploader(hf_export: HFExport | None) -> HubUploader | None:
    """The background Hub uploader of a run with ``HFExport(upload_to=...)`` (rank 0), else
    ``None``. It is handed each step once its export is committed."""
    if hf_export is None or hf_export.upload_to is None:
        return None
    from lightning_mcore_ckpt.hf._upload import HubUploader

    return HubUploader(
        hf_export.upload_to, private=hf_export.private, attempts=hf_export.upload_attempts
    )


_CHECK = (
    "import json, sys\n"
    "from lightning_mcore_ckpt.hf import check_logits\n"
    "r = check_logits(sys.argv[1], sys.argv[2])\n"
    "print(json.dumps([r.max_abs_diff, r.atol, r.ok]))\n"
)


def _check_logits(target: Path) -> float:
    """``HFExport(check_logits=True)``: the logits check in a CPU subprocess (its own one-process
    Megatron-Core state, outside this rank's process groups); a failed check removes the copy."""
    hf_dir = target / layout.HF_DIR
    keep = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in keep}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, str(hf_dir), str(target)],
        capture_output=True,
        text=True,
        env=env,
    )
    try:
        diff, atol, ok = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        shutil.rmtree(hf_dir, ignore_errors=True)
        raise RuntimeError(f"the logits check could not run: {done.stderr[-2000:]}") from None
    if not ok:
        shutil.rmtree(hf_dir, ignore_errors=True)
        raise RuntimeError(
            f"the logits check failed: the export's logits differ from the step's Megatron-Core "
            f"model's by {diff:.3g} (tolerance {atol:g}); the copy was removed. Check the "
            "hf_model_path is the model this run was trained from"
        )
    log.info("logits check of %s: largest |difference| %.3g", hf_dir, diff)
    return float(diff)


def export_into_committed(hf_export: HFExport, target: Path) -> dict[str, Any]:
    """Export the committed step ``target`` into its ``huggingface/``; the export's figures.

    The step stays complete throughout: ``huggingface/`` appears by rename, then the step's
    metadata is replaced (durably, atomically) with the export's time and the new files. A step
    whose commit failed is not exported (``{}``). A failed export raises ``RuntimeError``
    saying that the step itself is intact.
    """
    from lightning_mcore_ckpt import hf

    metadata = markers.read_metadata(target)
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
            adapters=hf_export.adapters,
            head=hf_export.head,
            require_complete=False,
            overwrite=True,
            progress=False,
        )
        seconds = time.perf_counter() - start
        metadata["hf_export_time_s"] = seconds
        if hf_export.check_logits:
            metadata["hf_logits_max_abs_diff"] = _check_logits(target)
        contents = list(metadata.get("contents") or [])
        if "hf_model" not in contents:
            contents.append("hf_model")
        metadata["contents"] = contents
        # The copy is new (or replaced): its files are hashed afresh at this seal.
        hf_files = f"{layout.HF_DIR}/"
        kept = (metadata.get("hashes") or {}).items()
        metadata["hashes"] = {k: v for k, v in kept if not k.startswith(hf_files)}
        seal_step(target, metadata)  # sealed again, with the export
    except Exception as err:
        raise RuntimeError(
            f"the Hugging Face export of {target} failed (the step itself is committed and "
            f"intact; export it again with `lightning-mcore-ckpt export`): "
            f"{type(err).__name__}: {err}"
        ) from err
    log.info("exported %s/%s in %.1fs", target, layout.HF_DIR, seconds)
    # Only the export's figure: the save's own were logged at its commit.
    return {"global_step": metadata["global_step"], "hf_export_time_s": seconds}

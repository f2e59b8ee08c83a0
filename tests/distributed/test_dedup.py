"""Unchanged tensors written once (``ckpt_dedup=True``): a frozen base is written at the first
save, referenced by every later one, kept while referenced, and resumed from exactly.

Axes: sync/async x TP=2 over 2 gloo ranks; retention (max_to_keep) deleting the step that
wrote the shared files; a resume after it (bit-exact against an uninterrupted run); a frozen
weight changed through ``.data`` (no version bump: only the hash sees it); damage in a shared
file (fsck names it in every step that references it).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.cli import fsck
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.safety.safe_dcp import read_dcp_metadata
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

TRAINABLE = "gpt.output_layer.weight"


def _fit(
    rank: int,
    world_size: int,
    root: str,
    async_save: bool,
    max_steps: int,
    keep: int,
    resume: bool = False,
    touch_frozen_at: int | None = None,
    tp: int = 2,
) -> dict[str, Any]:
    from _frozen_models import FrozenBase
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy

    strategy = MegatronStrategy(
        tensor_model_parallel_size=tp, ckpt_async_save=async_save, ckpt_dedup=True
    )
    callback = MegatronCheckpoint(root, every_n_train_steps=2, save_last=False, max_to_keep=keep)
    trainer = make_trainer(
        max_steps, strategy, world_size, callbacks=[callback], enable_checkpointing=True
    )
    module = FrozenBase(touch_frozen_at=touch_frozen_at)
    trainer.fit(module, train_dataloaders=loader(32, 2), ckpt_path="last" if resume else None)
    return {
        "losses": [float(x) for x in module.step_losses],
        "weights": gathered_weights(trainer),
        "reused": trainer.strategy._writer.shards.dedup.reused_bytes,
    }


def _own_and_shared(step: Path) -> tuple[set[str], set[str]]:
    """Keys of model/ written into the step, and keys it points at in shared/."""
    index = read_dcp_metadata(step / "model")
    tensors = {k for k, md in index.state_dict_metadata.items() if hasattr(md, "size")}
    own, shared = set(), set()
    for where, info in index.storage_data.items():
        if where.fqn in tensors:
            (shared if info.relative_path.startswith("../../shared/") else own).add(where.fqn)
    return own, shared


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_frozen_base_is_written_once_kept_while_referenced_and_resumed_exactly(
    tmp_path: Path, async_save: bool
) -> None:
    whole = run_distributed(_fit, 2, str(tmp_path / "whole"), async_save, 6, 2, timeout=250)
    run = tmp_path / "whole"
    # Retention deleted step 2, which wrote the frozen base; 4 and 6 point at its files.
    assert [s.step for s in layout.complete_steps(run)] == [4, 6]
    shared = sorted(p.name for p in (run / "shared").iterdir())
    assert shared and all(name.startswith("global_step_2-model-") for name in shared)
    for step in (run / "global_step_4", run / "global_step_6"):
        own, referenced = _own_and_shared(step)
        # Only the trainable weight was written into the step; the frozen base is referenced.
        assert own == {TRAINABLE}, own
        assert TRAINABLE not in referenced and len(referenced) > 10
        meta = markers.read_metadata(step)
        assert meta is not None
        assert {f"../shared/{n}" for n in shared} <= set(meta["files"])
        assert layout.verify_step(step, deep=True) == []
    # The frozen base is most of the model: the later saves wrote none of it.
    assert all(r["reused"] > 0 for r in whole)
    # Interrupted after step 4 (step 2 deleted by max_to_keep=1), resumed from it to step 6.
    part = tmp_path / "part"
    run_distributed(_fit, 2, str(part), async_save, 4, 1, timeout=250)
    assert [s.step for s in layout.complete_steps(part)] == [4]
    resumed = run_distributed(_fit, 2, str(part), async_save, 6, 1, True, timeout=250)
    for r_whole, r_resumed in zip(whole, resumed, strict=True):
        assert r_resumed["losses"] == r_whole["losses"][4:]
        for key, tensor in r_whole["weights"].items():
            assert torch.equal(tensor, r_resumed["weights"][key]), key
    # The resumed run's first save pointed at the frozen base step 4 was loaded from: step 2's
    # files, kept after step 4 went because step 6 references them.
    assert [s.step for s in layout.complete_steps(part)] == [6]
    assert all(r["reused"] > 0 for r in resumed)
    left = {p.name for p in (part / "shared").iterdir()}
    meta = markers.read_metadata(part / "global_step_6")
    assert meta is not None
    assert left == {n.rsplit("/", 1)[1] for n in meta["files"] if n.startswith("../shared/")}
    assert left and all(n.startswith("global_step_2-") for n in left)


def test_a_frozen_weight_changed_through_data_is_written_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ranks = run_distributed(_fit, 2, str(run), False, 4, 2, False, 3, timeout=250)
    # Step 4's embedding differs from step 2's: the hash saw it although no version changed.
    step4 = run / "global_step_4"
    _, referenced = _own_and_shared(step4)
    index = read_dcp_metadata(step4 / "model")
    files = {
        info.relative_path
        for where, info in index.storage_data.items()
        if where.fqn == "gpt.embedding.word_embeddings.weight"
    }
    assert files and all("global_step_4-model-" in f for f in files), files
    from lightning_mcore_ckpt.cli import diff

    changed = {t.key for t in diff.diff_steps(run / "global_step_2", step4).differing}
    assert "gpt.embedding.word_embeddings.weight" in changed
    assert ranks[0]["weights"]["gpt.embedding.word_embeddings.weight"][0, 0] != 0
    assert "gpt.decoder.final_layernorm.weight" in referenced  # the rest is still reused


def test_damage_in_a_shared_file_is_found_in_every_step_that_references_it(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run_distributed(_fit, 2, str(run), False, 4, 2, timeout=250)
    target = sorted((run / "shared").iterdir())[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    assert fsck.check(run).damaged == []  # sizes unchanged
    found = fsck.check(run, deep=True)
    assert [s.path.name for s in found.damaged] == ["global_step_2", "global_step_4"]
    assert all(any(target.name in p for p in s.problems) for s in found.damaged)
    shutil.rmtree(run)


def test_a_resume_into_another_layout_writes_its_own_pieces(tmp_path: Path) -> None:
    # Saved with TP=2 (each rank's piece of the frozen base in shared/), resumed with TP=1: the
    # one rank's pieces are other ones, so nothing stored may be pointed at.
    run = tmp_path / "run"
    run_distributed(_fit, 2, str(run), False, 4, 1, timeout=250)
    (resumed,) = run_distributed(_fit, 1, str(run), False, 6, 2, True, None, 1, timeout=250)
    step6 = run / "global_step_6"
    # The pieces TP splits were written again; replicated ones (layer norms) are the same
    # pieces in both layouts and may be pointed at.
    index = read_dcp_metadata(step6 / "model")
    split = [
        info.relative_path
        for where, info in index.storage_data.items()
        if where.fqn == "gpt.decoder.layers.self_attention.linear_qkv.weight"
    ]
    assert split and all("global_step_6-model-" in p for p in split), split
    assert resumed["reused"] < 64 * 1024  # at most the layer norms
    assert layout.verify_step(step6, deep=True) == []
    from lightning_mcore_ckpt.cli import diff

    changed = {t.key for t in diff.diff_steps(run / "global_step_4", step6).differing}
    assert changed == {TRAINABLE}  # the frozen base reads back the same in both layouts

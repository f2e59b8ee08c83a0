"""Unchanged tensors written once: a model with a frozen base saved with and without
``ckpt_dedup``, side by side (same state, same minutes).

The whole GPT is frozen and a LoRA-like adapter trains (with AdamW): the adapter has 1/27 of
the base's parameters, so with its two moments the frozen base is 90 % of a step's bytes.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks import workloads

SAVES = 4


def _frozen_base(size: str) -> Any:
    import torch

    module = workloads._module(size)

    class FrozenBase(type(module)):  # type: ignore[misc]
        def configure_model(self) -> None:
            super().configure_model()
            for p in self.gpt.parameters():
                p.requires_grad_(False)
            if getattr(self, "adapter", None) is None:
                base = sum(p.numel() for p in self.gpt.parameters())
                self.adapter = torch.nn.Parameter(torch.zeros(base // 27))

        def forward(self, inputs: Any, labels: Any) -> Any:
            # The adapter's update: it changes at every step (its gradient is never zero).
            return super().forward(inputs, labels) + 1e-6 * self.adapter.sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([self.adapter], lr=1e-4)

    module.__class__ = FrozenBase
    module.adapter = None
    return module


def frozen_saves(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's figures for each mode: steady save time (every save but the first), the bytes
    a step holds itself, and the bytes the run directory holds at the end."""

    from lightning_mcore_ckpt import MegatronCheckpoint
    from lightning_mcore_ckpt.format import layout, markers

    out: dict[str, Any] = {}
    for mode in ("plain", "dedup"):
        root = Path(cfg["dir"]) / mode
        module = _frozen_base(cfg["size"])
        callback = MegatronCheckpoint(root, every_n_train_steps=1, save_last=False)
        device = cfg.get("device", "cpu")
        trainer = workloads._trainer(
            SAVES, 1, world, [callback], False, device, ckpt_dedup=mode == "dedup"
        )
        trainer.fit(module, train_dataloaders=workloads._loader())
        if rank == 0:
            metas = sorted(
                (markers.read_metadata(s.path) or {} for s in layout.complete_steps(root)),
                key=lambda m: m["global_step"],
            )
            steps = [layout.step_dir(root, m["global_step"]) for m in metas]
            frozen = sum(
                p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad
            )
            out[mode] = {
                "first_save_s": metas[0]["total_time_s"],
                "save_s": statistics.median(m["total_time_s"] for m in metas[1:]),
                "step_bytes": statistics.median(workloads.tree_bytes(s) for s in steps[1:]),
                "run_bytes": workloads.tree_bytes(root),
                "frozen_bytes": frozen,
                "first_step_bytes": workloads.tree_bytes(steps[0]),
            }
    return out


def report(size: str, figures: dict[str, Any]) -> tuple[list[str], tuple[str, bool, str]]:
    """Markdown lines and the target's verdict."""
    plain, dedup = figures["plain"], figures["dedup"]
    share = plain["frozen_bytes"] / plain["first_step_bytes"]
    faster = plain["save_s"] / dedup["save_s"]
    smaller = plain["step_bytes"] / dedup["step_bytes"]
    lines = [
        f"### Unchanged tensors written once ({size}, frozen base: {share:.0%} of a step)",
        "",
        "| | first save s | later saves s (median) | bytes a later step holds | run directory |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {name} | {m['first_save_s']:.3f} | {m['save_s']:.3f} | "
            f"{m['step_bytes'] / 2**20:.1f} MiB | {m['run_bytes'] / 2**20:.1f} MiB |"
            for name, m in (("without dedup", plain), ("ckpt_dedup=True", dedup))
        ),
        "",
        f"From the second save on: {faster:.1f}x faster, {smaller:.1f}x fewer bytes per step.",
        "",
    ]
    ok = faster >= 5 and smaller >= 5
    verdict = (
        f"{size}/1p: frozen base, later saves >= 5x faster and smaller with ckpt_dedup",
        ok,
        f"{faster:.1f}x faster, {smaller:.1f}x smaller",
    )
    return lines, verdict

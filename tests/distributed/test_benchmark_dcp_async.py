"""The benchmark's DCP async baseline saves again and again with one stager, whatever torch does
with it.

torch 2.11's ``dcp.async_save`` closes the stager it is given once a save is written; the GPU run
then failed its second save with ``KeyError: <class 'type'>`` (a closed ``StateDictStager`` has
emptied its deep-copy dispatch table). Matrix: the stager built with the options for {the CPU, CUDA}
(as far as the CPU allows: torch ignores the pinning asked for, and refuses non-blocking copies
without an accelerator, so those are off; the same stager class, the same reuse) x torch
{closes the caller's stager after each save (2.11), closes the deep-copy stager inside it directly,
leaves it open (2.13)}. Every save must
write the state it was given (loaded back and compared), and the closes torch made are counted.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
SAVES = 3


def _cells(rank: int, world: int, tmp: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks import baselines

    own_async_save, build = dcp.async_save, baselines.dcp_stager

    def closing(inner: bool) -> Any:
        def closing_async_save(*args: Any, **kwargs: Any) -> Any:
            # What torch 2.11 does: the caller's stager (or, here, the deep-copy stager inside
            # it) is closed once the save is written (here before the call returns, so that the
            # next save surely meets a closed stager).
            response = own_async_save(*args, **kwargs)
            stager = kwargs.get("async_stager")
            getattr(response, "upload_completion", response).result()
            if stager is not None:
                (stager._state_dict_stager if inner else stager).close()
            return response

        return closing_async_save

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for stager_device in ("cpu", "cuda"):
        for torch_closes in ("stager", "deep-copy stager", "nothing"):
            cell = f"{stager_device}, torch closes: {torch_closes}"
            root = Path(tmp) / cell.replace(" ", "_").replace(":", "").replace(",", "")
            gen = torch.Generator().manual_seed(len(results))
            plain = {f"w{i}": torch.randn(64, 32, generator=gen) for i in range(4)}
            plain["step"] = torch.tensor(7)
            written: list[bool] = []

            def fresh(name: str, root: Path = root) -> Path:
                path = root / name
                path.mkdir(parents=True)
                return path

            def remove(
                path: Path, plain: dict[str, Any] = plain, written: list[bool] = written
            ) -> None:
                back = {k: torch.zeros_like(v) for k, v in plain.items()}
                dcp.load(back, checkpoint_id=str(path))
                written.append(all(torch.equal(back[k], v) for k, v in plain.items()))
                shutil.rmtree(path)

            options = baselines.dcp_staging_options(torch.device(stager_device))
            options.use_non_blocking_copy = False  # needs an accelerator
            baselines.dcp_stager = lambda _device, o=options: (baselines._kept_stager(o), "")
            if torch_closes == "nothing":
                dcp.async_save = own_async_save
            else:
                dcp.async_save = closing(inner=torch_closes == "deep-copy stager")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # pinning asked without CUDA
                    figures = baselines.dcp_async_saves(
                        plain, fresh, remove, None, torch.device("cpu"), SAVES
                    )
                results[cell] = {**figures, "written": written}
            except Exception as error:  # noqa: BLE001 - the test names it
                results[cell] = {"error": repr(error)}
            finally:
                baselines.dcp_stager, dcp.async_save = build, own_async_save
    options = baselines.dcp_staging_options(torch.device("cuda"))
    results["cuda options"] = [
        options.use_pinned_memory,
        options.use_non_blocking_copy,
        options.use_async_staging,
    ]
    return results


def test_the_dcp_async_baseline_reuses_its_stager_whether_or_not_torch_closes_it(
    tmp_path: Path,
) -> None:
    results = run_distributed(_cells, 1, str(tmp_path), timeout=500)[0]
    assert results.pop("cuda options") == [True, True, False]
    assert len(results) == 6
    for cell, figures in results.items():
        assert "error" not in figures, f"{cell}: {figures.get('error')}"
        assert figures["written"] == [True] * SAVES, cell
        assert figures["save_s"]["median"] > 0 and figures["first_blocking_s"] > 0, cell
        closes = 0 if cell.endswith("closes: nothing") else SAVES
        assert figures["stager_closes_by_torch"] == closes, cell

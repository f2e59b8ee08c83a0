"""A mixture-of-experts step saved with Megatron-Core's distributed optimizer, loaded into
other expert- and data-parallel layouts.

With expert parallelism (EP > 1) Megatron-Core's ``get_megatron_optimizer`` builds a
``ChainedOptimizer`` of a dense and an expert optimizer; with EP = 1, one optimizer. Saved
``fully_reshardable``, the step records which parameters each inner optimizer's groups held,
and a load gives each live group the saved group of its own parameters.

Axes covered:

- the optimizer sharding: ``fully_reshardable`` (loads into every layout below) and
  ``dp_reshardable`` (loads across data-parallel sizes only; an expert-parallel change is
  refused before any tensor is loaded, from the step's ``metadata.json``, naming
  ``ckpt_optimizer_sharding="fully_reshardable"`` and the weights-only load);
- the layout change: EP 2 -> 1 (2 processes -> 1, and 2 -> 2, where the experts' data-parallel
  size goes 1 -> 2), EP 1 -> 2 (1 process -> 2), DP 2 -> 1 and 1 -> 2 at EP = 1;
- what is compared: every weight, every optimizer tensor (Adam's moments, the fp32 main
  parameters) gathered whole, and each parameter's group (learning rate, betas, weight decay)
  and Adam's step, saved and restored; training continues;
- ``lightning-mcore-ckpt inspect <step> --ep N --dp M`` predicts each outcome, compared with
  the real load.

- EP 2 -> TP 2 (2 processes; the experts split by tensor instead of by expert, with the
  sequence parallelism Megatron-Core requires for MoE at TP > 1).

Not covered: data-parallel changes at EP > 1 (4 processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.cli.entry import main as cli_main
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(400)

# (sharding, (saving world, EP), (loading world, EP), loads)
CASES = [
    ("fully_reshardable", (2, 2), (1, 1), True),
    ("fully_reshardable", (1, 1), (2, 2), True),
    ("fully_reshardable", (2, 2), (2, 1), True),
    ("fully_reshardable", (2, 1), (1, 1), True),
    ("fully_reshardable", (2, 2), (2, "tp2"), True),
    ("dp_reshardable", (1, 1), (2, 1), True),
    ("dp_reshardable", (2, 2), (1, 1), False),
    ("dp_reshardable", (1, 1), (2, 2), False),
    ("dp_reshardable", (2, 2), (2, "tp2"), False),
]


def _name(case: tuple[object, ...]) -> str:
    sharding, (sw, sep), (lw, lep), _ = case  # type: ignore[misc]
    to = f"w{lw}{lep}" if isinstance(lep, str) else f"w{lw}ep{lep}"
    return f"{sharding}-w{sw}ep{sep}-to-{to}"


def _inspect(step: Path, ep: int | str, world: int, capsys: pytest.CaptureFixture[str]) -> bool:
    capsys.readouterr()
    sizes = ["--tp", "2", "--ep", "1", "--dp", "1"] if ep == "tp2" else ["--ep", str(ep)]
    if ep != "tp2":
        sizes += ["--dp", str(world)]
    code = cli_main(["inspect", str(step), *sizes, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["loadable"] else 1)
    return bool(report["loadable"])


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_a_moe_step_loads_into_the_layouts_its_sharding_allows(
    tmp_path: Path, case: tuple[object, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    from _moe import SAVED_STEPS, hf_source, refused_load, resume, train_and_save

    sharding, (save_world, save_ep), (load_world, load_ep), loads = case  # type: ignore[misc]
    hf_source(tmp_path)
    saved = run_distributed(train_and_save, save_world, str(tmp_path), save_ep, sharding)[0]
    step = tmp_path / f"global_step_{SAVED_STEPS}"
    metadata = json.loads((step / "metadata.json").read_text())
    assert metadata["optimizer_sharding"] == sharding
    assert metadata["parallel_layout"]["expert_model_parallel_size"] == save_ep
    # A dense and an expert optimizer at EP > 1, one at EP = 1.
    assert metadata["distributed_optimizer_parts"] == [2 if save_ep > 1 else 1]
    optim = saved["optim"]
    experts = [k for k in optim if ".experts." in k and ".exp_avg." in k]
    assert experts and any(".exp_avg_sq." in k for k in optim), sorted(optim)[:5]
    assert any(k.startswith("optimizer.state.param.") for k in optim)  # fp32 main params
    # The prediction, from metadata only, before the real load.
    assert _inspect(step, load_ep, load_world, capsys) is loads

    if not loads:
        before = sorted(p.name for p in step.rglob("*"))
        refused = run_distributed(
            refused_load, load_world, str(tmp_path), str(step), load_ep, sharding, False
        )
        message = refused[0]["error"]
        changed = (
            "tensor_model_parallel_size=1 saved, 2 now"
            if load_ep == "tp2"
            else f"expert_model_parallel_size={save_ep} saved, {load_ep} now"
        )
        for needed in (
            "ckpt_optimizer_sharding='dp_reshardable'",
            changed,
            "ckpt_optimizer_sharding='fully_reshardable'",
            f"MegatronStrategy(init_from={str(step)!r})",
        ):
            assert needed in message, message
        # Refused before any tensor was loaded: the live run's tensors are unchanged.
        for r in refused:
            assert r["error"].startswith(message) or message.startswith(r["error"])
            assert r["tensors"] > 0 and r["changed"] == [], r["changed"]
        assert sorted(p.name for p in step.rglob("*")) == before
        return

    loaded = run_distributed(resume, load_world, str(tmp_path), load_ep, sharding)
    for r in loaded:
        assert r["start_step"] == SAVED_STEPS
        assert r["weights"].keys() == saved["weights"].keys()
        for key, tensor in saved["weights"].items():
            assert torch.equal(tensor, r["weights"][key]), f"weight {key}"
        assert r["optim"].keys() == optim.keys()
        for key, tensor in optim.items():
            assert torch.equal(tensor, r["optim"][key]), f"optimizer state {key}"
        # Each parameter's group and Adam's step, whichever inner optimizer holds it now.
        assert r["groups"] == saved["groups"]
        assert {g["step"] for g in r["groups"].values()} == {float(SAVED_STEPS)}
        assert r["end_step"] == SAVED_STEPS + 1
        assert r["losses"] and all(torch.isfinite(torch.tensor(x)) for x in r["losses"])

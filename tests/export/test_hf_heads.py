"""Value and reward heads, tied embeddings across pipeline stages, and the logits check.

Axes: the saving layout (TP=2; PP=2) x the exported head (value:
``*ForTokenClassification``; reward: ``*ForSequenceClassification``): each trained step is
exported both ways, so every pair is covered. Tied embeddings: PP=2 (the tied weight lives on
the first and the last stage; TP=2 is in tests/distributed/test_hf.py). The logits check: it
passes on every export here, fails on a wrong mapping that tensor-wise verification misses, and
``HFExport(check_logits=True)`` removes an export that fails it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import installed_cli, run_cli
from _crafted import replace_objects, touching
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-4
"""fp32 Megatron-Core (local layers) against fp32 transformers on the same weights."""
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}


def _gate_and_up_swapped(to_hf: Any) -> Any:
    """``HFBridge.to_hf`` with a wrong mapping: the MLP's gate and up projections swapped."""

    def swapped(self: Any, name: str, tensor: torch.Tensor) -> Any:
        out = to_hf(self, name, tensor)
        if name.endswith("linear_fc1.weight"):
            (gate, g), (up, u) = out
            return [(gate, u), (up, g)]
        return out

    return swapped


def _checked_export_trainer(tmp: str, world_size: int, **layout: Any) -> Any:
    """3 steps from ``tmp/src``'s weights, saved at step 3 and exported with the logits check."""
    from _trainer import make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy

    src = str(Path(tmp, "src"))
    export = HFExport(src, when="end", check_logits=True)
    return make_trainer(
        3,
        MegatronStrategy(init_from=src, **layout),
        world_size,
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), every_n_train_steps=3, hf_export=export)],
        enable_checkpointing=True,
    )


def _train_critic(rank: int, world_size: int, tmp: str, layout: str) -> dict[str, Any]:
    from _trainer import loader
    from _value_models import HFValueModule

    trainer = _checked_export_trainer(tmp, world_size, **LAYOUTS[layout])
    module = HFValueModule(str(Path(tmp, "src")), lr=1e-2)
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    trainer.fit(module, train_dataloaders=loader(16, 2))
    out: dict[str, Any] = {"probe": probe, "losses": [float(x) for x in module.step_losses]}
    if layout == "tp2":
        with torch.no_grad():
            out["values"] = module.values(probe)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_critic_exports_as_value_and_reward_models_that_compute_what_it_computed(
    tmp_path: Path, layout: str
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", "qwen2")
    run = run_distributed(_train_critic, 2, str(tmp_path), layout, timeout=280)[0]
    step = tmp_path / "ckpt" / "global_step_3"
    value_dir = step / "huggingface"

    # when="end" with head="auto": a one-output head is exported as token classification.
    config = json.loads((value_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    assert config["id2label"] == {"0": "LABEL_0"} and not config["tie_word_embeddings"]
    meta = json.loads((step / "metadata.json").read_text())
    assert 0 <= meta["hf_logits_max_abs_diff"] <= hf.LOGITS_ATOL  # HFExport(check_logits=True)
    critic = AutoModelForTokenClassification.from_pretrained(value_dir, local_files_only=True)
    critic.eval()
    assert torch.equal(critic.score.bias, torch.zeros(1))
    probe = run["probe"]
    with torch.no_grad():
        values = critic(probe).logits
    assert values.shape == (2, 12, 1)
    if "values" in run:  # the trained Megatron-Core critic, in the run, at TP=2
        torch.testing.assert_close(run["values"], values, rtol=0, atol=ATOL)
    # It trained, starting from the language model's body (with a fresh value head).
    from safetensors.torch import load_file

    body = "model.layers.0.mlp.down_proj.weight"
    before, after = (
        load_file(str(src / "model.safetensors")),
        load_file(str(value_dir / "model.safetensors")),
    )
    assert not torch.equal(before[body], after[body])
    assert (before[body] - after[body]).abs().max() < 0.1  # from the LM's weights, not afresh

    # The same step as a reward model: the score is the last token's value.
    reward_dir = tmp_path / "reward"
    done = installed_cli(
        "export", str(step), "--hf-model", str(src), "--out", str(reward_dir), "--head", "reward"
    )
    assert done.returncode == 0, done.stderr
    assert "lightning" not in done.imported, sorted(done.imported)  # the export needs none
    reward = AutoModelForSequenceClassification.from_pretrained(reward_dir, local_files_only=True)
    reward.eval()
    with torch.no_grad():
        scores = torch.cat([reward(row[None]).logits for row in probe])
    torch.testing.assert_close(scores, values[:, -1], rtol=0, atol=ATOL)
    assert reward.config.architectures == ["Qwen2ForSequenceClassification"]

    # The logits check runs both exports against the step's own Megatron-Core model (PP=1).
    for out in (value_dir, reward_dir):
        done = run_cli("verify", str(out), "--reference", str(step), "--logits")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "OK: they match" in done.stdout
    assert "values:" in run_cli("verify", str(value_dir), "--logits").stdout  # reference: its step

    # Value and reward models import back into steps that export to the same files.
    for kind, exported in (("value", value_dir), ("reward", reward_dir)):
        again, back = tmp_path / f"imported-{kind}", tmp_path / f"back-{kind}"
        assert run_cli("import", str(exported), "--out", str(again)).returncode == 0
        done = run_cli("export", str(again), "--hf-model", str(exported), "--out", str(back))
        assert done.returncode == 0, done.stderr
        for name in ("model.safetensors", "config.json"):
            assert (back / name).read_bytes() == (exported / name).read_bytes()

    # A head the checkpoint does not have is refused before anything is written.
    bad = tmp_path / "bad"
    done = run_cli("export", str(step), "--hf-model", str(src), "--out", str(bad), "--head", "lm")
    assert done.returncode == 2 and "one-output value head" in done.stderr
    assert not bad.exists()


def _train_tied_pp2(rank: int, world_size: int, tmp: str, broken: bool) -> dict[str, Any]:
    from _trainer import loader

    from lightning_mcore_ckpt.hf import HFBridge
    from lightning_mcore_ckpt.tiny import HFGPTModule

    if broken:  # this rank's export swaps gate and up: the logits check (a subprocess) sees it
        HFBridge.to_hf = _gate_and_up_swapped(HFBridge.to_hf)  # type: ignore[method-assign]
    trainer = _checked_export_trainer(tmp, world_size, pipeline_model_parallel_size=2)
    module = HFGPTModule(str(Path(tmp, "src")), lr=1e-2)
    try:
        trainer.fit(module, train_dataloaders=loader(16, 2))
    except RuntimeError as err:
        if not broken:
            raise
        return {"error": str(err)}
    # Both copies of the tied weight, one per stage: the stages kept them equal.
    return {"tied": module.model.shared_embedding_or_output_weight().detach().clone()}


def test_tied_embeddings_trained_across_two_stages_export_once_and_pass_the_logits_check(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", "llama", tie_word_embeddings=True)
    first, last = run_distributed(_train_tied_pp2, 2, str(tmp_path), False, timeout=280)
    torch.testing.assert_close(first["tied"], last["tied"], rtol=0, atol=0)
    exported = tmp_path / "ckpt" / "global_step_3" / "huggingface"
    weights = load_file(str(exported / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True
    embed = weights["model.embed_tokens.weight"]
    torch.testing.assert_close(embed, first["tied"][: embed.shape[0]], rtol=0, atol=0)
    assert not torch.equal(
        embed, load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"]
    )  # it trained
    meta = json.loads((exported.parent / "metadata.json").read_text())
    assert meta["hf_logits_max_abs_diff"] <= 1e-4


def test_the_logits_check_catches_a_wrong_mapping_that_tensor_checks_miss(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "llama", tie_word_embeddings=True)
    errors = run_distributed(_train_tied_pp2, 2, str(tmp_path), True, timeout=280)
    assert all("the logits check failed" in r["error"] for r in errors), errors
    step = tmp_path / "ckpt" / "global_step_3"
    # The step is committed and intact; the wrong copy was removed, not recorded.
    meta = json.loads((step / "metadata.json").read_text())
    assert "hf_model" not in meta["contents"] and not (step / "huggingface").exists()

    # The same wrong mapping, by hand: compared tensor by tensor against the step (converted
    # with the same mapping) it passes; run, it does not.
    from lightning_mcore_ckpt import hf

    original = hf.HFBridge.to_hf
    out = tmp_path / "wrong"
    try:
        hf.HFBridge.to_hf = _gate_and_up_swapped(original)  # type: ignore[method-assign]
        hf.export_checkpoint(step, tmp_path / "src", out)
        assert hf.verify_export(out, step).ok
    finally:
        hf.HFBridge.to_hf = original  # type: ignore[method-assign]
    result = hf.check_logits(out, step)
    assert not result.ok and result.max_abs_diff > 10 * hf.LOGITS_ATOL
    done = run_cli("verify", str(out), "--reference", str(step), "--logits")
    assert done.returncode == 1 and "FAILED" in done.stdout
    hf.export_checkpoint(step, tmp_path / "src", tmp_path / "right")
    assert hf.check_logits(tmp_path / "right", step).max_abs_diff <= 1e-4

    # The reference step is a file from outside too: an object in it that would run code is
    # refused before anything of it is unpickled.
    with open(step / "model" / ".metadata", "rb") as f:
        index = pickle.load(f)  # our own, real index
    key = next(
        k for k, md in index.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)
    )
    marker = tmp_path / "ran"
    assert replace_objects(step / "model", key, touching(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        hf.check_logits(tmp_path / "right", step)
    assert not marker.exists()

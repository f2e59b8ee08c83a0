"""LoRA adapters: trained in a Megatron-Core model (TP=2 and TP=1),
exported merged into the weights or as a PEFT adapter, checked against the model's own logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import installed_cli, run_cli

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

RANK, ALPHA = 4, 8.0
LOGITS_ATOL = 1e-4
"""fp32 Megatron-Core (local layers) against fp32 transformers on the same weights."""
STEPS = 4
ADAPTER_KEYS = ("adapter.linear_in.weight", "adapter.linear_out.weight")


def _train(rank: int, world_size: int, tmp: str, tp: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule
    from lightning_mcore_ckpt.training.adapters import add_lora

    class LoRAModule(HFGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            add_lora(self.model, rank=RANK, alpha=ALPHA)

        def configure_optimizers(self) -> Any:
            # Plain SGD: its step is linear in the gradient, so TP=2 and TP=1 runs stay within
            # float rounding of each other (Adam turns rounding noise in near-zero gradients
            # into full-size steps).
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=2.0)

    def gathered_weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        # Built factories included (gate/up of linear_fc1 and of its adapter's B).
        from megatron.core.dist_checkpointing.mapping import apply_factories

        from lightning_mcore_ckpt.testing import gather_sharded

        state = trainer.strategy.model_sharded_state_dict()
        apply_factories(state)
        return gather_sharded(state)

    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    out: dict[str, Any] = {"probe": probe}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            out["start"] = gathered_weights(trainer)
            out["trainable"] = sorted(n for n, p in module.named_parameters() if p.requires_grad)

    src = str(Path(tmp, "src"))
    # TP=2: the callback's export at the end (merged). TP=1: the frozen base is written once
    # (dedup) and reused by the second save.
    export = HFExport(src, adapters="merged") if tp == 2 else None
    strategy = MegatronStrategy(tensor_model_parallel_size=tp, init_from=src, ckpt_dedup=tp == 1)
    ckpt = MegatronCheckpoint(Path(tmp, f"tp{tp}"), every_n_train_steps=2, hf_export=export)
    trainer = make_trainer(
        STEPS, strategy, world_size, callbacks=[ckpt, Capture()], enable_checkpointing=True
    )
    module = LoRAModule(src, lr=5e-2)
    trainer.fit(module, train_dataloaders=loader(16, 2))
    with torch.no_grad():
        out["logits"] = module.logits(probe)
    out["end"] = gathered_weights(trainer)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tmp = tmp_path_factory.mktemp("lora")
    tiny_hf_model(tmp / "src", "qwen2")
    results = {2: run_distributed(_train, 2, str(tmp), 2, timeout=280)[0]}
    results[1] = run_distributed(_train, 1, str(tmp), 1, timeout=280)[0]
    return tmp, results


def _hf_logits(path: Path, probe: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        return model(probe).logits


def _adapters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if k.endswith(ADAPTER_KEYS)}


@pytest.mark.parametrize("tp", [2, 1])
def test_only_the_adapters_train(runs: Any, tp: int) -> None:
    _, results = runs
    run = results[tp]
    assert run["trainable"] and all(n.endswith(ADAPTER_KEYS) for n in run["trainable"])
    assert len(run["trainable"]) == 16  # 2 layers x 4 targets x (A, B)
    # Saved under Megatron-Bridge's names, stacked over layers: A [layers, rank, in], B [.., rank].
    adapters = _adapters(run["end"])
    assert sorted(adapters) == sorted(
        f"model.decoder.layers.{m}.{k}"
        for m in (
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            "mlp.linear_fc1",
            "mlp.linear_fc2",
        )
        for k in ADAPTER_KEYS
    )
    for key, value in adapters.items():
        assert value.shape[0] == 2 and value.shape[1 if "linear_in" in key else 2] == RANK
        if "linear_out" in key:  # B starts at zero and trained
            assert run["start"][key].abs().max() == 0 and value.abs().max() > 1e-3, key
    for key, value in run["start"].items():
        if key.endswith(ADAPTER_KEYS):
            continue
        assert torch.equal(value, run["end"][key]), f"{key}: the frozen base changed"


def test_tensor_parallel_training_gives_the_single_rank_adapters(runs: Any) -> None:
    # Same base, same initial A (drawn by layer name), same batches: the gradients through
    # Megatron-Core's tensor-parallel mappings are the unsplit ones.
    _, results = runs
    tp2, tp1 = _adapters(results[2]["end"]), _adapters(results[1]["end"])
    for key in tp1:
        torch.testing.assert_close(tp2[key], tp1[key], rtol=0, atol=2e-5, msg=key)
    torch.testing.assert_close(results[2]["logits"], results[1]["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("tp", [2, 1])
def test_merged_and_peft_exports_compute_the_trained_model(runs: Any, tp: int) -> None:
    tmp, results = runs
    run, src = results[tp], tmp / "src"
    step = tmp / f"tp{tp}" / f"global_step_{STEPS}"
    if tp == 2:  # HFExport(adapters="merged") exported the last step
        merged = step / "huggingface"
        assert (merged / "model.safetensors").is_file()
    else:
        merged = tmp / "tp1-merged"
        done = installed_cli("export", str(step), "--hf-model", str(src), "--out", str(merged))
        assert done.returncode == 0, done.stderr
        assert "lightning" not in done.imported, sorted(done.imported)  # the export needs none
    merged_logits = _hf_logits(merged, run["probe"])
    torch.testing.assert_close(merged_logits, run["logits"], rtol=0, atol=LOGITS_ATOL)
    base_logits = _hf_logits(src, run["probe"])
    assert (merged_logits - base_logits).abs().max() > 100 * LOGITS_ATOL  # the adapters count
    # The merged export against its step: tensor by tensor (merged on the fly) and run, the
    # step's Megatron-Core model with its adapters attached (unmerged) on one process.
    done = run_cli("verify", str(merged), "--reference", str(step), "--atol", "1e-6", "--logits")
    assert done.returncode == 0 and "logits:" in done.stdout, done.stdout + done.stderr

    peft_dir = tmp / f"tp{tp}-peft"
    done = run_cli(
        "export", str(step), "--hf-model", str(src), "--out", str(peft_dir), "--adapters", "peft"
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in peft_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(src)
    from safetensors import safe_open

    with safe_open(str(peft_dir / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q_a = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        k_a = f.get_tensor("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight")
    assert len(keys) == 2 * 2 * 7  # layers x modules x (A, B)
    assert torch.equal(q_a, k_a)  # the fused QKV's A is shared by q, k and v
    peft_logits = _hf_logits(src, run["probe"], adapter=peft_dir)
    torch.testing.assert_close(peft_logits, merged_logits, rtol=0, atol=LOGITS_ATOL)


def test_dedup_writes_the_frozen_base_once(runs: Any) -> None:
    tmp, _ = runs
    run_dir = tmp / "tp1"
    shared = list((run_dir / "shared").iterdir())
    assert shared, "the frozen base was not written to shared/"
    second = json.loads((run_dir / "global_step_4" / "metadata.json").read_text())
    first = json.loads((run_dir / "global_step_2" / "metadata.json").read_text())
    refs = [f for f in second.get("files", {}) if f.startswith("../shared/")]
    assert refs and set(refs) <= set(first.get("files", {}))  # reused, not written again


def test_bad_adapter_exports_are_refused_before_writing(runs: Any, tmp_path: Path) -> None:
    from lightning_mcore_ckpt import HFExport
    from lightning_mcore_ckpt.cli.entry import main as cli_main
    from lightning_mcore_ckpt.hf import export_checkpoint

    tmp, _ = runs
    src, step = tmp / "src", tmp / "tp1" / f"global_step_{STEPS}"
    imported = tmp_path / "plain"
    assert run_cli("import", str(src), "--out", str(imported)).returncode == 0
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        export_checkpoint(imported, src, out, adapters="peft")
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    with pytest.raises(ValueError, match=r"adapters='lora' \(--adapters\)"):
        export_checkpoint(step, src, out, adapters="lora")
    with pytest.raises(ValueError, match=r"records alpha=8\.0"):
        export_checkpoint(step, src, out, lora_alpha=16)
    with pytest.raises(ValueError, match=r"HFExport: adapters='both'"):
        HFExport(src, adapters="both")  # type: ignore[arg-type]
    assert cli_main(["export", str(step), "--hf-model", str(src), "--out", str(out),
                     "--lora-alpha", "-1"]) == 2  # fmt: skip
    assert not out.exists()

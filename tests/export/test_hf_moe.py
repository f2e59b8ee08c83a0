"""Hugging Face export of a mixture of experts trained and saved with expert parallelism.

A tiny mixture of experts of each family mbridge converts (4 experts, 2 routed per token;
Qwen2-MoE with a gated shared expert, Qwen3-MoE with query/key norms, Mixtral) trains on 2 gloo
processes with ``expert_model_parallel_size=2`` (each process holds 2 of the experts), saves,
and is exported once when ``fit`` ends. The export reads one expert of one layer at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.cli.entry import main as cli_main
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(400)

MOE: dict[str, Any] = dict(hidden_size=32, intermediate_size=256, num_experts=4)
"""Each expert's gate/up weight (512 x 32) is the model's largest tensor slice."""
FAMILIES = {
    # family -> Hugging Face tensors of every layer ({e}: each expert) that the export must write
    "qwen2_moe": [
        "mlp.gate.weight",
        "mlp.shared_expert_gate.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
    ],
    "qwen3_moe": ["mlp.gate.weight", "self_attn.q_norm.weight", "mlp.experts.{e}.up_proj.weight"],
    "mixtral": ["block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w3.weight"],
}
EXPERT_SLICE_BYTES = 2 * 256 * 32 * 4
"""One expert's fused gate/up weight of one layer, fp32."""
LOGITS_ATOL = 1e-4


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _hf_logits(path: Path, probe: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(probe).logits


def _train(rank: int, world_size: int, tmp: str, ep: int, sgd: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import HFGPTModule

    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    out: dict[str, Any] = {"probe": probe}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            with torch.no_grad():
                out["logits_at_start"] = module.logits(probe)
            out["local_experts"] = len(module.model.decoder.layers[0].mlp.experts.local_experts)

    class SGDModule(HFGPTModule):
        # Plain SGD: an update proportional to the gradient (Adam's is not), so a wrongly
        # scaled or mixed expert gradient shows in the weights.
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=5.0)

    src = str(Path(tmp, "src"))
    callbacks: list[Any] = [Probe()]
    if not sgd:
        callbacks.append(
            MegatronCheckpoint(
                Path(tmp, "ckpt"), every_n_train_steps=2, hf_export=HFExport(src, when="end")
            )
        )
    trainer = make_trainer(
        3,
        MegatronStrategy(expert_model_parallel_size=ep, init_from=src),
        world_size,
        callbacks=callbacks,
        enable_checkpointing=not sgd,
        # Clipped by the norm of the whole model's gradient, each process's experts included.
        gradient_clip_val=0.05 if sgd else None,
    )
    module = (SGDModule if sgd else HFGPTModule)(src, lr=1e-2)
    trainer.fit(module, train_dataloaders=loader(32, 2))
    with torch.no_grad():
        out["logits_at_end"] = module.logits(probe)
    return out


def _load_at_ep1_and_export(rank: int, world_size: int, tmp: str) -> None:
    from _trainer import resave_on_this_layout_and_export

    resave_on_this_layout_and_export(tmp, "ckpt/global_step_3", "ep1")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_then_export_of_a_moe_gives_back_the_same_files(tmp_path: Path, family: str) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", family, **MOE)
    step = tmp_path / "imported"
    assert cli_main(["import", str(src), "--out", str(step)]) == 0
    out = tmp_path / "exported"
    assert cli_main(["export", str(step), "--hf-model", str(src), "--out", str(out)]) == 0
    # Experts one per expert, the router (Qwen2-MoE: the shared expert and its gate): byte for
    # byte.
    assert _files(out) == _files(src)


@pytest.mark.parametrize(("family", "renormalised"), [("qwen2_moe", True), ("qwen3_moe", False)])
def test_the_router_weighs_the_chosen_experts_as_the_config_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str, renormalised: bool
) -> None:
    # norm_topk_prob the other way round from the tiny models (and mbridge's fixed choice):
    # the imported step computes the logits transformers computes.
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", family, **MOE)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "norm_topk_prob": renormalised}))
    step = tmp_path / "imported"
    assert cli_main(["import", str(src), "--out", str(step)]) == 0
    verify = ["verify", str(src), "--reference", str(step), "--logits", "--atol", str(LOGITS_ATOL)]
    assert cli_main(verify) == 0, capsys.readouterr().out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_trained_with_ep2_exports_one_expert_at_a_time_and_matches_logits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    family: str,
) -> None:
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from lightning_mcore_ckpt.hf import _reader
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", family, **MOE)
    ranks = run_distributed(_train, 2, str(tmp_path), 2, False, timeout=300)
    run = ranks[0]
    ckpt = tmp_path / "ckpt"
    step = ckpt / "global_step_3"

    # Expert parallelism was real: each process held 2 of the 4 experts and wrote them.
    assert [r["local_experts"] for r in ranks] == [2, 2]
    metadata = FileSystemReader(str(step / "model")).read_metadata()
    (fc1,) = [
        k for k in metadata.state_dict_metadata if k.endswith(".experts.experts.linear_fc1.weight")
    ]
    chunks = metadata.state_dict_metadata[fc1].chunks
    assert list(metadata.state_dict_metadata[fc1].size) == [2, 4, 512, 32]
    files = {
        c.offsets[1]: metadata.storage_data[MetadataIndex(fc1, c.offsets)].relative_path
        for c in chunks
    }
    assert sorted(files) == [0, 1, 2, 3], files  # one chunk per expert and layer...
    assert {files[0], files[1]}.isdisjoint({files[2], files[3]}), files  # ...from 2 writers

    # init_from with EP=2: Megatron-Core computes what transformers computes from src.
    torch.testing.assert_close(
        run["logits_at_start"], _hf_logits(src, run["probe"]), rtol=0, atol=LOGITS_ATOL
    )
    # when="end": one export, into the final step; the exported model computes the trained
    # Megatron-Core model's logits.
    assert not (ckpt / "global_step_2" / "huggingface").exists()
    exported = step / "huggingface"
    assert "hf_model" in json.loads((step / "metadata.json").read_text())["contents"]
    end = _hf_logits(exported, run["probe"])
    assert (end - _hf_logits(src, run["probe"])).abs().max() > 100 * LOGITS_ATOL  # it trained
    torch.testing.assert_close(run["logits_at_end"], end, rtol=0, atol=LOGITS_ATOL)
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    wanted = {
        f"model.layers.{layer}.{name.format(e=e)}"
        for layer in range(2)
        for name in FAMILIES[family]
        for e in range(4)
    }
    assert wanted <= names, sorted(wanted - names)

    # The command line's export of the step, with every tensor the reader returns recorded:
    # the same files, and never more than one expert of one layer in memory at once.
    calls: list[dict[str, torch.Tensor]] = []  # what each read returned
    buffers: list[int] = []  # bytes of the buffers each read filled from the files
    original_read = _reader.SliceReader.read
    original_planner = _reader.SlicePlanner.__init__

    def recording_read(self: Any, wanted: Any) -> dict[str, torch.Tensor]:
        got = original_read(self, wanted)
        calls.append(got)
        return got

    def recording_planner(self: Any, requests: Any) -> None:
        buffers.append(sum(dest.nbytes for _, dest in requests.values()))
        original_planner(self, requests)

    monkeypatch.setattr(_reader.SliceReader, "read", recording_read)
    monkeypatch.setattr(_reader.SlicePlanner, "__init__", recording_planner)
    out = tmp_path / "cli_export"
    assert cli_main(["export", str(step), "--hf-model", str(src), "--out", str(out)]) == 0
    assert _files(out) == _files(exported)
    experts = [(k, tuple(v.shape)) for got in calls for k, v in got.items() if ".experts.lin" in k]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    assert {shape for name, shape in experts if "linear_fc1" in name} == {(512, 32)}
    # At most one expert of one layer in memory at once: a quarter of the layer's experts.
    assert len(buffers) == len(calls)
    assert max(buffers) == EXPERT_SLICE_BYTES
    assert max(sum(v.nbytes for v in got.values()) for got in calls) == EXPERT_SLICE_BYTES
    monkeypatch.undo()

    assert cli_main(["verify", str(exported), "--reference", str(step), "--logits"]) == 0
    assert "OK: they match" in capsys.readouterr().out

    # Loaded back on one process (EP=1: all experts) and exported there: the same files.
    run_distributed(_load_at_ep1_and_export, 1, str(tmp_path), timeout=200)
    assert _files(tmp_path / "ep1_hf") == _files(exported)


def test_ep2_training_updates_experts_as_ep1_does(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", "qwen2_moe", **MOE)
    ep2 = run_distributed(_train, 2, str(tmp_path), 2, True, timeout=300)[0]
    ep1 = run_distributed(_train, 2, str(tmp_path), 1, True, timeout=300)[0]
    # The same data on 2 data-parallel ranks, experts split over them or replicated: the same
    # model after 3 clipped SGD steps.
    assert (ep1["logits_at_end"] - ep1["logits_at_start"]).abs().max() > 100 * LOGITS_ATOL
    torch.testing.assert_close(ep2["logits_at_end"], ep1["logits_at_end"], rtol=0, atol=1e-5)


def test_moe_run_with_expert_parallelism_and_export_comes_from_yaml(tmp_path: Path) -> None:
    import yaml
    from jsonargparse import ArgumentParser

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    src = tiny_hf_model(tmp_path / "src", "qwen2_moe", **MOE)
    config = yaml.safe_load(
        f"""
        strategy:
          class_path: lightning_mcore_ckpt.MegatronStrategy
          init_args: {{expert_model_parallel_size: 2, init_from: {src}}}
        callback:
          class_path: lightning_mcore_ckpt.MegatronCheckpoint
          init_args:
            dirpath: {tmp_path / "ckpt"}
            hf_export: {{hf_model_path: {src}, when: end}}
        """
    )
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=MegatronStrategy)
    parser.add_argument("--callback", type=MegatronCheckpoint)
    built = parser.instantiate_classes(parser.parse_object(config))
    assert built.strategy.expert_model_parallel_size == 2
    assert built.callback.hf_export == HFExport(str(src), when="end")

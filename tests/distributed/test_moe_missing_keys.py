"""A load never re-initialises a tensor silently: everything the live mixture of experts and
its optimizer will restore must be in the step, or the load fails before any live tensor
changes, naming the missing keys and the way to load without them on purpose.

Axes covered (2 processes, EP = 2, Megatron-Core's distributed optimizer, a ``ChainedOptimizer``
of a dense and an expert optimizer):

- what is missing: an expert weight's Adam moment in ``optim/`` (the grouped experts' key removed from the
  torch_dist index, the step's record made consistent again, so that only the key is
  missing), and the router's ``expert_bias`` in ``model/`` (a step saved from a model whose
  router has none, loaded into one with ``moe_router_enable_expert_bias=True``);
- what is checked: the error names the key and the escape hatch (the weights-only load
  ``MegatronStrategy(init_from=<step>)`` for the optimizer, ``strict_loading = False`` for
  weights), on every rank; every parameter, buffer and optimizer tensor (moments, step, main
  parameters) of the live run is unchanged by the failed load;
- the escape hatch for weights: ``strict_loading = False`` loads the rest exactly and leaves
  ``expert_bias`` as the model initialised it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _drop_from_index(step: Path, sub: str, key: str) -> None:
    """Remove ``key`` from the torch_dist index of ``step/sub``, as if it had never been
    saved, and record the index's new size in the step's commit marker (still whole)."""
    from torch.distributed.checkpoint import FileSystemReader

    index_file = step / sub / ".metadata"
    index = FileSystemReader(str(step / sub)).read_metadata()
    assert key in index.state_dict_metadata, sorted(index.state_dict_metadata)[:10]
    del index.state_dict_metadata[key]
    index.storage_data = {i: s for i, s in index.storage_data.items() if i.fqn != key}
    index_file.write_bytes(pickle.dumps(index))
    meta = json.loads((step / "metadata.json").read_text())
    name = f"{sub}/.metadata"
    meta["files"][name] = index_file.stat().st_size
    meta.get("hashes", {}).pop(name, None)
    meta[integrity.METADATA_HASH] = integrity.json_digest(meta)
    (step / "metadata.json").write_text(json.dumps(meta))


def _assert_refused(refused: list[dict[str, object]], needed: list[str]) -> None:
    for r in refused:
        message = str(r["error"])
        for text in needed:
            assert text in message, message
        assert "nothing was loaded" in message
        # Nothing of the live run changed: weights, buffers, every optimizer tensor.
        assert r["tensors"] and r["changed"] == [], r["changed"]


def test_a_step_without_an_expert_adam_moment_is_refused_before_any_tensor_changes(
    tmp_path: Path,
) -> None:
    from _moe import SAVED_STEPS, hf_source, refused_load, train_and_save

    hf_source(tmp_path)
    saved = run_distributed(train_and_save, 2, str(tmp_path), 2, "fully_reshardable")[0]
    step = tmp_path / f"global_step_{SAVED_STEPS}"
    expert = sorted(k for k in saved["optim"] if ".experts." in k and ".exp_avg." in k)[-1]
    _drop_from_index(step, "optim", expert)

    refused = run_distributed(
        refused_load, 2, str(tmp_path), str(step), 2, "fully_reshardable", False
    )
    _assert_refused(refused, [repr(expert), f"MegatronStrategy(init_from={str(step)!r})"])


def test_a_step_without_the_routers_expert_bias_is_refused_before_any_tensor_changes(
    tmp_path: Path,
) -> None:
    from _moe import SAVED_STEPS, hf_source, refused_load, train_and_save

    hf_source(tmp_path)
    saved = run_distributed(train_and_save, 2, str(tmp_path), 2, "fully_reshardable", False)[0]
    step = tmp_path / f"global_step_{SAVED_STEPS}"

    refused = run_distributed(
        refused_load, 2, str(tmp_path), str(step), 2, "fully_reshardable", True
    )
    _assert_refused(refused, ["router.expert_bias'", "strict_loading = False"])

    # The escape hatch: strict_loading = False loads the rest, the bias as initialised.
    from _moe import partial_load

    loaded = run_distributed(partial_load, 2, str(tmp_path), 2)[0]
    assert loaded["step"] == SAVED_STEPS
    biases = [k for k in loaded["weights"] if k.endswith("router.expert_bias")]
    assert biases and all(not loaded["weights"][k].any() for k in biases)
    for key, tensor in saved["weights"].items():
        assert torch.equal(tensor, loaded["weights"][key]), key


MOE_ADAMW = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
    "moe_token_dispatcher_type": "alltoall",
}


def _adamw_save(rank: int, world_size: int, tmp: str) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = make_trainer(
        2,
        MegatronStrategy(expert_model_parallel_size=2),
        world_size,
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), every_n_train_steps=2)],
        enable_checkpointing=True,
    )
    trainer.fit(TinyGPTModule(transformer_config=MOE_ADAMW), train_dataloaders=loader(16))


def _adamw_refused(rank: int, world_size: int, tmp: str, step: str) -> dict[str, object]:
    from _moe import load_refused
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = make_trainer(1, MegatronStrategy(expert_model_parallel_size=2), world_size)
    trainer.fit(TinyGPTModule(transformer_config=MOE_ADAMW), train_dataloaders=loader(8))
    return load_refused(trainer, step)


def test_a_torch_adamw_step_without_one_experts_second_moment_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    # torch AdamW over an MoE at EP=2: its state is saved per parameter like the weights; a
    # parameter whose exp_avg is there and exp_avg_sq is not is named before any load.
    from torch.distributed.checkpoint import FileSystemReader

    run_distributed(_adamw_save, 2, str(tmp_path))
    step = tmp_path / "ckpt" / "global_step_2"
    keys = FileSystemReader(str(step / "optim")).read_metadata().state_dict_metadata
    expert = sorted(k for k in keys if ".experts." in k and ".exp_avg_sq." in k)[0]
    _drop_from_index(step, "optim", expert)

    refused = run_distributed(_adamw_refused, 2, str(tmp_path), str(step))
    _assert_refused(refused, [repr(expert), f"MegatronStrategy(init_from={str(step)!r})"])

"""``check-resume`` on a LightningCLI config of a mixture-of-experts job: experts split over 2
ranks (``expert_model_parallel_size`` in the YAML), the model's router and experts set as
``TransformerConfig`` fields from the YAML (``transformer_config``), Megatron-Core's
distributed optimizer (a chain of a dense and an expert optimizer). A correct job is EXACT; a
module that adds router state no checkpoint holds is found, at the first resumed step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt import check_resume

pytestmark = [pytest.mark.matrix, pytest.mark.timeout(400)]

MOE = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
    "moe_token_dispatcher_type": "alltoall",
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.01,
}


def _config(tmp_path: Path, model: str) -> Path:
    import yaml

    config: dict[str, Any] = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "max_steps": 4,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {
                "class_path": "lightning_mcore_ckpt.MegatronStrategy",
                "init_args": {"expert_model_parallel_size": 2},
            },
            "callbacks": [
                {
                    "class_path": "lightning_mcore_ckpt.MegatronCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "job"), "every_n_train_steps": 1},
                }
            ],
        },
        "model": {
            "class_path": model,
            "init_args": {"optimizer": "distributed", "transformer_config": MOE},
        },
        "data": {
            "class_path": "lightning_mcore_ckpt.tiny.TokenDataModule",
            "init_args": {"num_samples": 16, "batch_size": 2},
        },
    }
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_moe_job_from_a_lightningcli_config_resumes_exactly(tmp_path: Path) -> None:
    report = check_resume(
        _config(tmp_path, "lightning_mcore_ckpt.tiny.TinyGPTModule"),
        stop_at=2,
        how="sigterm",
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)


def test_router_state_a_module_adds_and_no_checkpoint_holds_is_found(tmp_path: Path) -> None:
    report = check_resume(
        _config(tmp_path, "_subclass_jobs.RouterStateGPTModule"),
        stop_at=2,
        how="sigterm",
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert not report.exact, str(report)
    print(report)
    assert "step 3" in str(report)

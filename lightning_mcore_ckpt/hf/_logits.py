"""The logits check: an export and its step run the same tokens; their outputs must agree.

Comparing tensors against our own conversion cannot catch a wrong name map or a wrong fused-QKV
split: the export and the reference would be wrong together. Running both networks can. The
exported directory runs in transformers; the step runs in the Megatron-Core model its config
describes, built on one CPU process with the step's weights loaded by Megatron-Core's own
``dist_checkpointing.load`` (any saved layout), without any Hugging Face conversion.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

import lightning_mcore_ckpt.hf._heads as _heads
from lightning_mcore_ckpt import _cpu
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._reader import SliceReader, module_prefix
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp

__all__ = ["LOGITS_ATOL", "LogitsResult", "check_logits"]

LOGITS_ATOL = 1e-3
"""Default tolerance of :func:`check_logits`: fp32 on CPU agrees to ~1e-5 on small models; a
wrong mapping is off by the size of the logits themselves."""


@dataclasses.dataclass
class LogitsResult:
    """What :func:`check_logits` found.

    Example::

        result = check_logits("qwen-sft", "checkpoints/sft/global_step_3000", atol=1e-4)
        assert result.head == "lm" and result.max_abs_diff <= result.atol
    """

    head: str
    """``lm``, ``value`` or ``reward``: what was compared (logits, values, scores)."""
    batches: int
    tokens: int
    """Tokens per sequence."""
    max_abs_diff: float
    max_abs_value: float
    """Largest |output| of the Megatron-Core model: the scale ``max_abs_diff`` is judged on."""
    atol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.atol


def check_logits(
    exported: str | os.PathLike[str],
    step: str | os.PathLike[str],
    *,
    batches: int = 2,
    tokens: int = 16,
    atol: float = LOGITS_ATOL,
    seed: int = 0,
) -> LogitsResult:
    """Run fixed token batches through the export (transformers) and the step (Megatron-Core).

    Both run in float32 on CPU, the Megatron-Core model on one process with the step's weights
    loaded whatever layout saved them. Compares language-model logits (Megatron-Core's vocabulary
    padding cut off), per-token values (value heads) or per-sequence scores at the last token
    (reward heads). Memory: both models at once, in float32.

    Example::

        result = check_logits("qwen-sft", "checkpoints/sft/global_step_3000")
        assert result.ok, result.max_abs_diff
    """
    out_dir = Path(exported).expanduser()
    step_path = Path(step).expanduser()
    for name, value, low in (("batches", batches, 1), ("tokens", tokens, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"check_logits({name}={value!r}): pass an integer >= {low}")
    if isinstance(atol, bool) or not isinstance(atol, int | float) or not atol >= 0:
        raise ValueError(f"check_logits(atol={atol!r}) (--atol): pass a finite number >= 0")
    if not (out_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"verify --logits: {out_dir} is not a Hugging Face directory (no config.json)"
        )
    if not (step_path / layout.MODEL_DIR).is_dir():
        raise FileNotFoundError(
            f"verify --logits: --reference {step_path} is not a step directory (it has no "
            f"{layout.MODEL_DIR}/); the logits check runs the step's Megatron-Core model"
        )
    _cpu.install()  # the CPU adaptations, where there is no CUDA (a no-op otherwise)
    if not _cpu.on_cpu():
        raise RuntimeError(
            "check_logits runs both models on the CPU: call it in a process without CUDA "
            "devices, or use `lightning-mcore-ckpt verify EXPORT --logits` (which runs there)"
        )
    bridge = HFBridge(out_dir, dtype=torch.float32, argument="verify --logits")
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, bridge.vocab_size, (batches, tokens), generator=generator)
    theirs = _hf_outputs(out_dir, bridge.head, inputs)
    mine = _megatron_outputs(bridge, step_path, inputs)
    diff = (mine.double() - theirs.double()).abs().max().item()
    return LogitsResult(
        head=bridge.head,
        batches=batches,
        tokens=tokens,
        max_abs_diff=diff if not math.isnan(diff) else math.inf,
        max_abs_value=mine.abs().max().item(),
        atol=float(atol),
    )


def _hf_outputs(path: Path, head: str, inputs: torch.Tensor) -> torch.Tensor:
    model = _heads.auto_model_class(head).from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        if head == "reward":  # one sequence at a time: no padding token is needed to pool
            return torch.cat([model(row[None]).logits for row in inputs])
        return model(inputs).logits.float()


def _megatron_outputs(bridge: HFBridge, step: Path, inputs: torch.Tensor) -> torch.Tensor:
    from megatron.core import dist_checkpointing

    from lightning_mcore_ckpt.hf._import import (
        megatron_environ_writes_undone,
        single_process_parallel_state,
    )

    reader = SliceReader(step / layout.MODEL_DIR)
    prefix = module_prefix(reader.tensors, step)
    with single_process_parallel_state(), megatron_environ_writes_undone():
        config = bridge.transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
        model: Any = bridge.gpt_model(config)
        _attach_adapters(model, reader, prefix, step)
        state = model.sharded_state_dict(prefix=prefix)
        # A step is a file from outside: its objects checked, then loaded from what was checked.
        _safe_dcp.check_dist_checkpoint(step / layout.MODEL_DIR)
        with _safe_dcp.checked_readers():
            loaded = dist_checkpointing.load(state, str(step / layout.MODEL_DIR))
        missing = model.load_state_dict(_strip(loaded, prefix), strict=False).missing_keys
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise ValueError(
                f"verify --logits: {step} has no weights for {', '.join(missing[:5])}: it is "
                f"not a checkpoint of the model {bridge.path / 'config.json'} describes"
            )
        model.eval()
        position_ids = torch.arange(inputs.shape[1]).expand_as(inputs)
        with torch.no_grad():
            out = model(inputs, position_ids, None).float()
    if bridge.head == "lm":
        return out[..., : bridge.vocab_size]
    if bridge.head == "reward":
        return out[:, -1]
    return out


def _attach_adapters(model: Any, reader: SliceReader, prefix: str, step: Path) -> None:
    """Give the model the step's LoRA adapters (same targets, rank and alpha), when it has any:
    the reference is the step's own unmerged forward, base plus adapters."""
    from lightning_mcore_ckpt.hf._adapters import find_adapters

    found = find_adapters(reader, prefix, step, None)
    if not found:
        return
    from lightning_mcore_ckpt.training.adapters import add_lora

    targets = sorted({lora.name.split(".")[-2] for lora in found.values()})
    ranks = {lora.a.shape[0] for lora in found.values()}
    alphas = {lora.alpha for lora in found.values()}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(
            f"verify --logits: {step}'s LoRA adapters have ranks {sorted(ranks)} and alphas "
            f"{sorted(alphas)}; the check rebuilds one rank and alpha for every layer"
        )
    add_lora(model, rank=ranks.pop(), alpha=alphas.pop(), targets=targets)


def _strip(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k.removeprefix(prefix): v for k, v in state.items() if isinstance(v, torch.Tensor)}

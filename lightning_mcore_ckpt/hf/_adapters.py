"""LoRA adapters in a checkpoint: merged into the exported weights, or written as a PEFT adapter.

Adapters are found by name (``<layer>.adapter.linear_in.weight``: ``A`` ``[rank, in]``,
``<layer>.adapter.linear_out.weight``: ``B`` ``[out, rank]``, ``<layer>.adapter.alpha``; see
:mod:`lightning_mcore_ckpt.training.adapters`). Merging adds ``alpha / rank * B @ A`` to the layer's weight
in Megatron-Core's layout (fused QKV, gate/up), one layer at a time, before mbridge splits it.
The PEFT layout needs ``A`` and ``B`` per Hugging Face module: the rows and columns each Hugging
Face tensor takes from the fused Megatron-Core weight are found by converting index tensors with
the same bridge, so ``B`` is split (and de-interleaved) exactly as the weight is and ``A`` is
shared by the modules of one fused weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._names import ADAPTER
from lightning_mcore_ckpt.hf._reader import Slice, SliceReader, module_prefix
from lightning_mcore_ckpt.hf._refused import refused

__all__ = ["ADAPTERS", "LoRAReader", "check_adapters_args", "open_adapters", "write_peft_adapter"]

ADAPTERS = ("merged", "peft")
"""The values of ``export_checkpoint(adapters=...)``."""
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoRASlices:
    """One layer's adapter in a checkpoint, beside the weight it adapts."""

    name: str
    """The base weight's Megatron-Core name (layer-indexed): ``decoder.layers.0....weight``."""
    base: Slice
    a: Slice
    b: Slice
    alpha: float


def find_adapters(
    reader: SliceReader, prefix: str, source: Path, lora_alpha: float | None
) -> dict[tuple[str, int | None], LoRASlices]:
    """The checkpoint's adapters, by their base weight's ``(key, layer)``; checked for shape.

    ``alpha`` comes from the checkpoint (``adapter.alpha``) or, for one saved without it, from
    ``lora_alpha``; both given and different is an error.
    """
    slices = dict(reader.slices(prefix))
    parts: dict[str, dict[str, Slice]] = {}
    for name, piece in slices.items():
        if ADAPTER in name:
            module, _, what = name.partition(ADAPTER)
            parts.setdefault(module, {})[what] = piece
    if not parts:
        return {}
    alphas = reader.read({m: p["alpha"] for m, p in parts.items() if "alpha" in p})
    found: dict[tuple[str, int | None], LoRASlices] = {}
    for module, p in sorted(parts.items()):
        base = slices.get(f"{module}.weight")
        a, b = p.get("linear_in.weight"), p.get("linear_out.weight")
        if base is None or a is None or b is None:
            raise ValueError(
                f"{source}: the LoRA adapter of {prefix}{module} is incomplete (it needs "
                f"{module}.weight, {module}{ADAPTER}linear_in.weight and linear_out.weight); "
                "export a checkpoint saved by a model with lightning_mcore_ckpt.add_lora"
            )
        rank = a.shape[0]
        if (
            len(base.shape) != 2
            or a.shape != (rank, base.shape[1])
            or b.shape
            != (
                base.shape[0],
                rank,
            )
        ):
            raise ValueError(
                f"{source}: the LoRA adapter of {prefix}{module} has A {list(a.shape)} and B "
                f"{list(b.shape)} for a weight of {list(base.shape)}; expected "
                "[rank, in] and [out, rank]"
            )
        saved = float(alphas[module].item()) if module in alphas else None
        if saved is not None and lora_alpha is not None and saved != lora_alpha:
            raise ValueError(
                f"export: lora_alpha={lora_alpha} (--lora-alpha), but the checkpoint records "
                f"alpha={saved} for {module}; leave lora_alpha out to use the recorded one"
            )
        alpha = saved if saved is not None else lora_alpha
        if alpha is None:
            raise ValueError(
                f"{source}: the LoRA adapter of {prefix}{module} has no recorded alpha "
                f"({module}{ADAPTER}alpha); pass lora_alpha= (--lora-alpha) as it was trained"
            )
        found[(base.key, base.layer)] = LoRASlices(module + ".weight", base, a, b, alpha)
    return found


class LoRAReader(SliceReader):
    """A :class:`SliceReader` that hides the adapters and, with ``merge``, reads each
    adapted weight as ``weight + alpha / rank * B @ A`` (computed in float32)."""

    def __init__(  # wraps an open reader (SliceReader.__init__ opens one)
        self,
        reader: SliceReader,
        adapters: Mapping[tuple[str, int | None], LoRASlices],
        merge: bool,
    ) -> None:
        self.inner = reader
        self.dir = reader.dir
        self.reader = reader.reader
        self.tensors = {k: v for k, v in reader.tensors.items() if ADAPTER not in k}
        self.adapters = dict(adapters)
        self.merge = merge

    def slices(self, prefix: str) -> list[tuple[str, Slice]]:
        return [(n, s) for n, s in self.inner.slices(prefix) if ADAPTER not in n]

    def read(self, wanted: Mapping[str, Slice]) -> dict[str, torch.Tensor]:
        out = self.inner.read(wanted)
        if not self.merge:
            return out
        for rid, piece in wanted.items():
            lora = self.adapters.get((piece.key, piece.layer))
            if lora is None:
                continue
            ab = self.inner.read({"a": lora.a, "b": lora.b})
            delta = (ab["b"].float() @ ab["a"].float()) * (lora.alpha / lora.a.shape[0])
            out[rid] = (out[rid].float() + delta).to(out[rid].dtype)
        return out


def _hf_index_maps(bridge: HFBridge, name: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """For each Hugging Face tensor of Megatron-Core weight ``name``: the rows and columns of the
    Megatron-Core weight it is made of (found by converting index tensors)."""
    rows, cols = shape
    by_row = torch.arange(rows, dtype=torch.float64)[:, None].repeat(1, cols)
    by_col = torch.arange(cols, dtype=torch.float64)[None, :].repeat(rows, 1)
    maps: dict[str, Any] = {}
    for (hf_name, r), (_, c) in zip(
        bridge.to_hf(name, by_row), bridge.to_hf(name, by_col), strict=True
    ):
        if not (bool((r == r[:, :1]).all()) and bool((c == c[:1, :]).all())):
            raise ValueError(
                f"{name} -> {hf_name}: mbridge's conversion is not a selection of rows and "
                "columns, so its LoRA adapter cannot be written in the PEFT layout; export with "
                "adapters='merged'"
            )
        maps[hf_name] = (r[:, 0].long(), c[0, :].long())
    return maps


def write_peft_adapter(
    bridge: HFBridge,
    reader: LoRAReader,
    out: Path,
    dtype: torch.dtype | None,
    base_model: str,
) -> dict[str, Any]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's LoRA layout for
    the Hugging Face model of ``bridge``) into ``out``; a summary (tensors, bytes, files)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    ranks = {lora.a.shape[0] for lora in reader.adapters.values()}
    alphas = {lora.alpha for lora in reader.adapters.values()}
    if len(ranks) > 1 or len(alphas) > 1:
        raise ValueError(
            f"the checkpoint's adapters have ranks {sorted(ranks)} and alphas {sorted(alphas)}; "
            "the PEFT layout written here takes one of each: export with adapters='merged'"
        )
    for lora in reader.adapters.values():
        ab = reader.inner.read({"a": lora.a, "b": lora.b})
        for hf_name, (rows, cols) in _hf_index_maps(bridge, lora.name, lora.base.shape).items():
            module = hf_name.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            for key, value in (("lora_A", ab["a"][:, cols]), ("lora_B", ab["b"][rows])):
                tensors[f"base_model.model.{module}.{key}.weight"] = value.to(
                    dtype or value.dtype
                ).contiguous()
    save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    alpha = alphas.pop()
    config = LoraConfig(
        r=ranks.pop(),
        lora_alpha=int(alpha) if alpha.is_integer() else alpha,  # type: ignore[arg-type]
        target_modules=sorted(modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        inference_mode=True,
    )
    config.save_pretrained(str(out))
    size = (out / PEFT_WEIGHTS).stat().st_size
    return {"tensors": len(tensors), "bytes": size, "files": 1}


def check_adapters_args(adapters: str, lora_alpha: float | None, where: str) -> None:
    """Refuse a bad ``adapters``/``lora_alpha``, and ``"peft"`` without peft installed."""
    if adapters not in ADAPTERS:
        raise refused(
            f"{where}: adapters={adapters!r} (--adapters): use 'merged' (LoRA adapters added "
            "into the weights: a plain model) or 'peft' (the adapters alone, PEFT's layout)"
        )
    if lora_alpha is not None and (
        isinstance(lora_alpha, bool) or not isinstance(lora_alpha, int | float) or lora_alpha <= 0
    ):
        raise refused(f"{where}: lora_alpha={lora_alpha!r} (--lora-alpha): pass a number > 0")
    if adapters == "peft":
        try:
            import peft  # noqa: F401
        except ImportError as err:
            raise ImportError(
                f"{where}: adapters='peft' writes its adapter_config.json with peft, which is "
                "not installed: pip install 'lightning-mcore-ckpt[peft]'"
            ) from err


def open_adapters(
    reader: SliceReader, source: Path, adapters: str, lora_alpha: float | None
) -> LoRAReader:
    """``reader`` with its adapters found and checked: merged into their weights when read
    (``"merged"``), or hidden (``"peft"``, which requires some)."""
    found = find_adapters(reader, module_prefix(reader.tensors, source), source, lora_alpha)
    if adapters == "peft" and not found:
        raise ValueError(
            f"export: adapters='peft' (--adapters peft), but {source} has no LoRA adapters "
            f"(tensors named *{ADAPTER}linear_in.weight); export its weights with "
            "adapters='merged' (the default), or pick a step of a run that used add_lora"
        )
    return LoRAReader(reader, found, merge=adapters == "merged")

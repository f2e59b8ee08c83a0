"""Hugging Face weights into a live, sharded Megatron-Core model.

Each rank reads only the layers of its pipeline stage and keeps its tensor-parallel part; no
collective is involved. :func:`check_model_matches` checks a live model's shapes against a
Hugging Face config without reading any weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_mcore_ckpt.hf._bridge import HFBridge
from lightning_mcore_ckpt.hf._names import ADAPTER, EXPERTS, LAYERS, VOCAB_KEYS, expert_name
from lightning_mcore_ckpt.hf._refused import refused
from lightning_mcore_ckpt.hf._safetensors import HFReader

__all__ = ["check_model_matches", "gpt_model_prefixes", "load_hf_weights"]


def gpt_model_prefixes(module: torch.nn.Module, argument: str, fix: str) -> list[str]:
    """The key prefixes of the Megatron-Core GPT models in ``module`` (``["model."]`` for
    ``self.model``): the models the Hugging Face conversion maps.

    Refuses, before any work, a module with none (``argument`` names the option that asked for
    the conversion, ``fix`` what to do instead), naming a hybrid model (``HybridModel``) it
    holds: mbridge maps no hybrid architecture.

    Example::

        prefixes = gpt_model_prefixes(pl_module, "MegatronStrategy(init_from=...)", "...")
    """
    from megatron.core.models.gpt import GPTModel

    from lightning_mcore_ckpt import _compat
    from lightning_mcore_ckpt.hf._bridge import supported_model_types

    prefixes = [f"{n}." for n, m in module.named_modules() if isinstance(m, GPTModel)]
    if prefixes:
        return prefixes
    hybrid = _compat.hybrid_model_class()
    found = [(n, type(m).__name__) for n, m in module.named_modules() if isinstance(m, hybrid)]
    what = (
        "the LightningModule's "
        + ", ".join(f"{name!r} is a {cls}" for name, cls in found)
        + " (a Megatron-Core hybrid model), and mbridge maps no hybrid architecture"
        if found
        else "the LightningModule has none"
    )
    raise refused(
        f"{argument}: the Hugging Face conversion maps Megatron-Core GPTModels (of the model "
        f"types {', '.join(supported_model_types())}), and {what}; {fix}"
    )


def _local_pieces(
    sharded_state_dict: dict[str, Any], prefixes: Sequence[str]
) -> list[tuple[str, Any, list[int]]]:
    """``(mcore_name, sharded tensor, offsets without the layer and expert axes)`` of a live
    model; a routed expert's weight is named per layer and expert, as mbridge names it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    out = []
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        prefix = next((p for p in prefixes if sh.key.startswith(p)), None)
        if prefix is None or ADAPTER in sh.key:  # LoRA adapters keep their initialisation
            continue
        name = sh.key[len(prefix) :]
        offsets = list(sh.global_offset)
        if sh.prepend_axis_num:
            layer = offsets[0]
            offsets = offsets[sh.prepend_axis_num :]
            if name.startswith(LAYERS):
                name = f"{LAYERS}{layer}.{name[len(LAYERS) :]}"
                if name.startswith(EXPERTS, len(f"{LAYERS}{layer}.")):
                    name = expert_name(name, sh.global_offset[1])
        out.append((name, sh, offsets))
    return out


def _value_head_from_lm(bridge: HFBridge, name: str, sh: Any) -> bool:
    """A live one-output value head, to be filled from a language model's weights (no source)."""
    return bool(bridge.head == "lm" and name == "output_layer.weight" and sh.global_shape[0] == 1)


def check_model_matches(
    bridge: HFBridge,
    sharded_state_dict: dict[str, Any],
    prefixes: Sequence[str],
    argument: str = "hf_model_path",
) -> None:
    """Raise when a live model's tensors do not have the shapes the Hugging Face config implies.

    Checks this rank's tensors (their global shapes), without reading any weights.
    """
    expected = bridge.expected_hf_shapes()
    problems = []
    checked: set[str] = set()
    for name, sh, _ in _local_pieces(sharded_state_dict, prefixes):
        if name in checked or _value_head_from_lm(bridge, name, sh):
            continue
        checked.add(name)
        want = tuple(sh.global_shape[sh.prepend_axis_num :])
        try:
            hf_names = bridge.hf_names(name)
        except ValueError as err:
            problems.append(str(err))
            continue
        missing = [n for n in hf_names if n not in expected]
        if missing:
            problems.append(f"{sh.key}: the Hugging Face model has no {', '.join(missing)}")
            continue
        fake = [torch.empty(expected[n], device="meta") for n in hf_names]
        rows = want[0] if name.endswith(VOCAB_KEYS) else None
        try:
            got = tuple(bridge.to_mcore(name, fake, rows=rows).shape)
        except (RuntimeError, AssertionError, ValueError) as err:
            problems.append(f"{sh.key} {list(want)}: cannot be built from the config ({err})")
            continue
        if got != want:
            problems.append(f"{sh.key}: the model has {list(want)}, the config gives {list(got)}")
    if problems:
        shown = "\n  ".join(problems[:12])
        raise ValueError(
            f"{argument}={str(bridge.path)!r}: the model does not match this Hugging Face config "
            f"({bridge.model_type}):\n  {shown}\npass the Hugging Face model the Megatron-Core "
            "model was built from"
        )


def load_hf_weights(
    prefixes: Sequence[str],
    hf_model_path: str | os.PathLike[str],
    sharded_state_dict: Callable[[], dict[str, Any]],
) -> int:
    """Copy Hugging Face weights into live Megatron-Core modules, each rank its own shards.

    ``sharded_state_dict()`` returns the modules' sharded state dict; ``prefixes`` are the key
    prefixes of the GPT models in it (``"model."`` for ``self.model``). Each rank reads only the layers
    it holds and keeps its tensor-parallel part; tensors are checked against the Hugging Face
    shapes first. A one-output value head (``HFBridge(head="value")``) loads from a value or
    reward model's ``score``; started from a language model, it keeps its initialisation (the
    usual start of a critic). Returns the number of tensors loaded.

    Example::

        load_hf_weights(["model."], "Qwen2.5-0.5B", strategy.model_sharded_state_dict)
    """
    bridge = HFBridge(hf_model_path, argument="init_from")
    check_model_matches(bridge, sharded_state_dict(), prefixes, argument="init_from")
    reader = HFReader(bridge.path)
    cache: dict[str, torch.Tensor] = {}
    count = 0
    for name, sh, offsets in _local_pieces(sharded_state_dict(), prefixes):
        if _value_head_from_lm(bridge, name, sh):
            continue  # a critic started from a language model: its value head stays as built
        if name not in cache:
            cache.clear()  # pieces of one tensor (gate/up halves) arrive one after the other
            hf_names = bridge.hf_names(name)
            try:
                hf_tensors = reader.get(hf_names)
            except KeyError as err:
                raise ValueError(
                    f"init_from={bridge.path}: the model's {sh.key} needs {err.args[0]!r}, which "
                    "is not in its weights; is this the model's Hugging Face checkpoint?"
                ) from None
            rows = sh.global_shape[sh.prepend_axis_num] if name.endswith(VOCAB_KEYS) else None
            cache[name] = bridge.to_mcore(name, hf_tensors, rows=rows)
        full = cache[name]
        want = tuple(sh.global_shape[sh.prepend_axis_num :])
        if tuple(full.shape) != want:
            raise ValueError(
                f"init_from={bridge.path}: {sh.key} has shape {list(want)} in the model but "
                f"{list(full.shape)} from the Hugging Face weights; the model does not match "
                "its config"
            )
        piece = full
        for dim, (start, length) in enumerate(zip(offsets, sh.local_shape, strict=True)):
            piece = piece.narrow(dim, start, length)
        with torch.no_grad():
            sh.data.copy_(piece)
        count += 1
    return count

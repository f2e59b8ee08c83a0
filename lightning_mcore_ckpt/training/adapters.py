"""LoRA adapters on the linear layers of a Megatron-Core model, checkpointed like Megatron-Bridge.

:func:`add_lora` freezes a model and gives each target linear layer (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``) a low-rank adapter, so that the layer computes
``base(x) + alpha / rank * B(A(x))``. The adapters are saved beside the layer's own weights under
the names Megatron-Bridge's LoRA uses (``<layer>.adapter.linear_in.weight``: ``A``,
``[rank, in]``; ``<layer>.adapter.linear_out.weight``: ``B``, ``[out, rank]``), TP-sharded and
stacked over layers as Megatron-Core stacks every layer weight, plus ``<layer>.adapter.alpha``
(``[1]``) so that an export knows the scaling without being told. The Hugging Face export
(:func:`lightning_mcore_ckpt.hf.export_checkpoint`) writes them merged into the weights or as a
PEFT adapter.

Tensor parallelism: for a column-parallel layer (``linear_qkv``, ``linear_fc1``) ``A`` is whole on
every rank and ``B`` is split by output rows; for a row-parallel layer (``linear_proj``,
``linear_fc2``) ``A`` is split by input columns and ``B`` is whole. Gradients go through
Megatron-Core's tensor-parallel mappings, so they are those of the unsplit layer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LORA_TARGETS", "LoRAAdapter", "add_lora"]

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linear layers of a Megatron-Core transformer layer that :func:`add_lora` can adapt."""
_COLUMN = ("linear_qkv", "linear_fc1")


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one tensor-parallel linear layer: ``alpha / rank * B(A(x))``.

    ``linear_in`` holds ``A`` and ``linear_out`` holds ``B`` (this rank's part of each); ``alpha``
    is a buffer, saved with them. Built by :func:`add_lora`.

    Example::

        add_lora(model, rank=8, alpha=16)
        model.decoder.layers[0].self_attention.linear_qkv.adapter.linear_out.weight  # B
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        alpha: float,
        column: bool,
        sequence_parallel: bool,
        tp_group: Any,
    ) -> None:
        super().__init__()
        self.rank = int(a.shape[0] if column else b.shape[1])
        self.linear_in = torch.nn.Linear(a.shape[1], a.shape[0], bias=False, device=a.device)
        self.linear_out = torch.nn.Linear(b.shape[1], b.shape[0], bias=False, device=b.device)
        with torch.no_grad():
            self.linear_in.weight.data = a
            self.linear_out.weight.data = b
        self.register_buffer("alpha", torch.tensor([float(alpha)], device=a.device))
        self.column = column
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tp

        group = self.tp_group
        if self.column:
            # x: the layer's input (this rank's sequence part with sequence parallelism). A is
            # whole on every rank, so the gradient of x through it is complete: no reduction.
            if self.sequence_parallel:
                x = tp.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=False, group=group
                )
            h = torch.nn.functional.linear(x, self.linear_in.weight)
            if self.tp_size > 1:  # B is split: A's gradient sums every rank's part
                h = tp.copy_to_tensor_model_parallel_region(h, group=group)
            y = torch.nn.functional.linear(h, self.linear_out.weight)
        else:
            # x: this rank's input columns; A is split the same way, B is whole.
            h = torch.nn.functional.linear(x, self.linear_in.weight)
            if self.tp_size > 1:
                h = tp.reduce_from_tensor_model_parallel_region(h, group=group)
            y = torch.nn.functional.linear(h, self.linear_out.weight)
            if self.sequence_parallel:
                y = tp.scatter_to_sequence_parallel_region(y, group=group)
        alpha: torch.Tensor = self.alpha  # type: ignore[assignment]
        return y * (alpha / self.rank).to(y.dtype)


class _LoRALinear:
    """Mixed into a target layer's class by :func:`add_lora`: the base layer plus its adapter.

    The layer keeps its own parameters where they were (its checkpoint keys do not change); the
    adapter is its child ``adapter``.
    """

    adapter: LoRAAdapter
    lora_target: str

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)  # type: ignore[misc]
        return output + self.adapter(input_).to(output.dtype), bias

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: Any = None
    ) -> dict[str, Any]:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out: dict[str, Any] = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        mine = f"{prefix}adapter."
        out = {k: v for k, v in out.items() if not k.startswith(mine)}
        adapter = self.adapter
        tensors = {
            "linear_in.weight": adapter.linear_in.weight,
            "linear_out.weight": adapter.linear_out.weight,
            "alpha": adapter.alpha,
        }
        axis = {"linear_out.weight": 0} if adapter.column else {"linear_in.weight": 1}
        sharded = make_sharded_tensors_for_checkpoint(tensors, mine, axis, sharded_offsets)
        config = getattr(self, "config", None)
        if self.lora_target == "linear_fc1" and getattr(config, "gated_linear_unit", False):
            # B's rows are gate then up, each split over TP like the base weight: stored as the
            # base weight is (all gate rows, then all up rows), whatever the TP size.
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = bool((metadata or {}).get("singleton_local_shards", False))
            key = f"{mine}linear_out.weight"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, singleton)
        out.update(sharded)
        return out


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRALinear, cls), {})
    return _CLASSES[cls]


def _parallel_mode(name: str, module: torch.nn.Module) -> bool:
    """Whether ``module`` is column-parallel (else row-parallel); refuses what is not supported."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    kind = type(module).__name__
    if hasattr(module, "adapter"):
        raise ValueError(f"add_lora: {name} already has an adapter; call add_lora once")
    if getattr(module, "is_expert", False):
        raise ValueError(f"add_lora: {name} is an expert layer ({kind}); MoE is not supported")
    if "LayerNorm" in kind:
        raise ValueError(
            f"add_lora: {name} is a {kind} (its layer norm is fused into the linear layer), "
            "which is not supported; build the model with a separate input layer norm "
            "(Megatron-Core's local layer spec)"
        )
    if (
        isinstance(module, ColumnParallelLinear)
        or getattr(module, "parallel_mode", None) == "column"
    ):
        if getattr(module, "gather_output", False):
            raise ValueError(f"add_lora: {name} gathers its output, which is not supported")
        column = True
    elif isinstance(module, RowParallelLinear) or getattr(module, "parallel_mode", None) == "row":
        if not getattr(module, "input_is_parallel", True):
            raise ValueError(f"add_lora: {name} splits its input itself, which is not supported")
        column = False
    else:
        raise ValueError(
            f"add_lora: {name} is a {kind}, not a Megatron-Core tensor-parallel linear layer"
        )
    if column != (name.rsplit(".", 1)[-1] in _COLUMN):
        raise ValueError(f"add_lora: {name} is a {kind}, not the usual parallel mode of its name")
    return column


def add_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = LORA_TARGETS,
    *,
    seed: int = 0,
) -> list[str]:
    """Freeze ``model`` and add a LoRA adapter to each of its ``targets`` linear layers.

    Call it in ``configure_model`` right after building the Megatron-Core model, before the
    optimizer is made: every parameter of ``model`` is frozen, and each target layer (by its
    attribute name) computes ``base(x) + alpha / rank * B(A(x))`` with ``B = 0`` at the start,
    so the model's output is unchanged until it trains. ``A`` is drawn (Kaiming-uniform, as
    PEFT's) from ``seed`` and the layer's name, the same whatever the parallel layout.
    ``MegatronStrategy(init_from=hf_dir)`` loads the base weights and leaves the adapters as
    they are. Returns the names of the adapted layers.

    Example::

        def configure_model(self):
            self.model = bridge.gpt_model(bridge.transformer_config())
            add_lora(self.model, rank=16, alpha=32, targets=("linear_qkv", "linear_proj"))
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"add_lora(rank={rank!r}): pass a positive int (e.g. 8, 16)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"add_lora(alpha={alpha!r}): pass a positive number (e.g. 2 * rank)")
    if isinstance(targets, str) or not targets or any(t not in LORA_TARGETS for t in targets):
        raise ValueError(
            f"add_lora(targets={targets!r}): pass a non-empty list of {list(LORA_TARGETS)}"
        )
    found = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets]
    if not found:
        raise ValueError(
            f"add_lora: {type(model).__name__} has no layer named {' or '.join(targets)}; pass "
            "the Megatron-Core model (e.g. a GPTModel) after it is built"
        )
    modes = {name: _parallel_mode(name, module) for name, module in found}
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in found:
        _wrap(name, module, modes[name], rank, float(alpha), seed)
    return [name for name, _ in found]


def _wrap(
    name: str, module: torch.nn.Module, column: bool, rank: int, alpha: float, seed: int
) -> None:
    from megatron.core import parallel_state

    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    group = getattr(module, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(group) if group is not None else 1
    tp_rank = dist.get_rank(group) if group is not None else 0
    out_rows, in_cols = weight.shape
    full_in = in_cols if column else in_cols * tp_size
    # The whole A, the same on every rank and at every layout; each rank keeps its part.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = (torch.rand(rank, full_in, generator=generator, dtype=torch.float64) * 2 - 1) / math.sqrt(
        full_in
    )
    if not column:
        a = a[:, tp_rank * in_cols : (tp_rank + 1) * in_cols]
    a = a.to(device=weight.device, dtype=weight.dtype).contiguous()
    b = torch.zeros(out_rows, rank, device=weight.device, dtype=weight.dtype)
    sequence_parallel = bool(getattr(module, "sequence_parallel", False)) and tp_size > 1
    module.__class__ = _lora_class(type(module))
    module.lora_target = name.rsplit(".", 1)[-1]  # type: ignore[assignment]
    module.adapter = LoRAAdapter(a, b, alpha, column, sequence_parallel, group)
    if tp_size > 1:  # the split one counts on every rank (gradient norm, optimizer sharding)
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        split = module.adapter.linear_out.weight if column else module.adapter.linear_in.weight
        set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)

"""The optimizer state a load creates before reading into it: torch's own layout, left unzeroed
only where the load overwrites it whole.

Axes: optimizer (Adam, AdamW with amsgrad, SGD with momentum), whether the checkpoint's saved
keys are known (they are on every load of a torch optimizer: each tensor made is then read
whole; without them, what is made may stay as made), frozen parameters (none, one).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.training import optim as _optim

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _params(frozen: bool) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5000, generator=g)) for _ in range(3)]
    if frozen:
        params[1].requires_grad_(False)
    return params


def _layout(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {
            k: (v.shape, v.dtype, v.device, v.item() if v.numel() == 1 else None)
            for k, v in optimizer.state[p].items()
        }
        for g in optimizer.param_groups
        for p in g["params"]
        if p in optimizer.state
    ]


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "one-frozen"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_state_made_for_a_load_has_the_layout_a_step_makes(
    name: str, frozen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a real step creates (a zero learning rate: the same state, nothing moved)...
    stepped_params = _params(frozen)
    stepped = OPTIMIZERS[name](stepped_params)
    for p in stepped_params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for group in stepped.param_groups:
        group["lr"] = 0.0
    stepped.step()
    for group in stepped.param_groups:
        group["lr"] = 0.1
    # ... is what init_state creates, entry for entry, with step counts at zero as before a step.
    params = _params(frozen)
    made = OPTIMIZERS[name](params)
    # The checkpoint's saved keys name the parameters that had state: the trainable ones.
    trainable = [p for p in params if p.requires_grad]
    monkeypatch.setattr(_optim, "_params_with_saved_state", lambda opt, ssd, keys: trainable)
    _optim.init_state(made, {}, {"the saved keys"})
    expected = [
        {
            k: (shape, dtype, device, 0.0 if value is not None else None)
            for k, (shape, dtype, device, value) in entry.items()
        }
        for entry in _layout(stepped)
    ]
    assert _layout(made) == expected
    assert all(torch.equal(a, b) for a, b in zip(params, _params(frozen), strict=True))
    assert all(p.grad is None for p in params)


class _Seen(torch.overrides.TorchFunctionMode):
    """Records the tensor factories torch's optimizer calls (after any mode inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.zeros_like, torch.empty_like):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("known", [True, False], ids=["saved-keys-known", "saved-keys-unknown"])
def test_adam_state_is_left_unzeroed_only_where_the_load_overwrites_it(
    known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _params(False)
    optimizer = torch.optim.AdamW(params, lr=0.1)
    monkeypatch.setattr(_optim, "_params_with_saved_state", lambda opt, ssd, keys: params)
    with _Seen() as seen:
        if known:
            _optim.init_state(optimizer, {}, {"every key"})
        else:
            _optim.init_state(optimizer)
    # Two moments per parameter: left uninitialised when every one is read whole next.
    assert seen.calls == (["empty_like"] * 6 if known else ["zeros_like"] * 6)
    assert len(optimizer.state) == 3
    if not known:
        assert all(torch.count_nonzero(s["exp_avg"]) == 0 for s in optimizer.state.values())

"""The optimizer state's sharded tensors kept from one save to the next: a save gets, for every
state tensor, exactly what Megatron-Core's ``make_sharded_optimizer_tensor`` makes, and reuses
the kept one only where nothing it is made from changed.

Axes: what changes between two saves (nothing; a parameter's sharding: its offset, its replica;
a state tensor replaced, as a load does; a state tensor's dtype, the same object through
``.data``; the optimizer's state for one parameter dropped) x optimizer (Adam: two state tensors a parameter;
SGD with momentum: one). Each save's result is compared field by field with Megatron-Core's own.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.training import _kept_optim_tensors, optim

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _model(params: list[torch.nn.Parameter], replica: int = 0, offset: int = 0) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        f"w{i}": ShardedTensor.from_rank_offsets(
            f"w{i}", p, (0, offset, offset + 1), replica_id=replica
        )
        for i, p in enumerate(params)
    }


def _trained(name: str) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(3)]
    opt = OPTIMIZERS[name](params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, params


def _moments(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> list[str]:
    return [k for k, v in opt.state[p].items() if v.dim() > 0]


def _tensors(state: dict[str, Any]) -> list[Any]:
    return [sh for per_param in state["state"].values() for sh in per_param.values()]


def _check_is_megatrons(
    opt: torch.optim.Optimizer, model: dict[str, Any], state: dict[str, Any]
) -> None:
    """Every sharded tensor equals, field by field, Megatron-Core's for the same state tensor
    (its data: the state tensor itself)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    by_param = dict(enumerate(model.values()))
    plain = opt.state_dict()["state"]
    for pid, per_param in state["state"].items():
        for key, got in per_param.items():
            want = make_sharded_optimizer_tensor(
                by_param[pid], plain[pid][key], prefix=f"optimizer.state.{key}"
            )
            assert type(got) is type(want)
            assert got.data is want.data
            assert {k: v for k, v in vars(got).items() if k != "data"} == {
                k: v for k, v in vars(want).items() if k != "data"
            }


CHANGES = ["nothing", "offset", "replica", "replaced", "retyped", "dropped"]


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_save_reuses_a_state_tensors_sharded_tensor_only_when_nothing_it_is_made_from_changed(
    name: str, change: str
) -> None:
    opt, params = _trained(name)
    kept = _kept_optim_tensors.kept_for(opt)
    per_param = len(_moments(opt, params[0]))
    first = optim.sharded_state_dict(opt, _model(params))
    assert (kept.made, kept.reused) == (3 * per_param, 0)
    model = _model(params)
    fresh = 0
    if change in ("offset", "replica"):
        model = _model(params, **{change: 1})
        fresh = 3 * per_param
    elif change == "replaced":  # a load's new state tensor, in place of the old
        key = _moments(opt, params[1])[0]
        opt.state[params[1]][key] = opt.state[params[1]][key].clone()
        fresh = 1
    elif change == "retyped":  # the same object, another dtype
        key = _moments(opt, params[2])[-1]
        opt.state[params[2]][key].data = opt.state[params[2]][key].data.double()
        fresh = 1
    elif change == "dropped":
        del opt.state[params[0]]
    second = optim.sharded_state_dict(opt, model)
    now = 3 * per_param - (per_param if change == "dropped" else 0)
    assert (kept.made, kept.reused) == (fresh, now - fresh)
    _check_is_megatrons(opt, model, second)
    assert all(a is not b for a, b in zip(_tensors(first), _tensors(second), strict=False))


def test_kept_tensors_keep_no_state_alive_and_forget_what_a_save_did_not_use() -> None:
    opt, params = _trained("sgd-momentum")
    optim.sharded_state_dict(opt, _model(params))
    buffer = weakref.ref(opt.state[params[0]]["momentum_buffer"])
    del opt.state[params[0]]
    gc.collect()
    assert buffer() is None  # the kept entry held it weakly
    optim.sharded_state_dict(opt, _model(params))
    kept = _kept_optim_tensors.kept_for(opt)
    assert (kept.made, kept.reused) == (0, 2)
    assert len(kept._kept) == 2


def test_megatrons_function_is_put_back_after_a_save_and_after_an_error() -> None:
    from megatron.core.dist_checkpointing import optimizer as mcore_optimizer

    stock = mcore_optimizer.make_sharded_optimizer_tensor
    opt, params = _trained("adam")
    optim.sharded_state_dict(opt, _model(params))
    assert mcore_optimizer.make_sharded_optimizer_tensor is stock
    with pytest.raises(ValueError, match="does not match any model sharded param"):
        optim.sharded_state_dict(opt, _model(params[:2]))  # a parameter the model lacks
    assert mcore_optimizer.make_sharded_optimizer_tensor is stock


def test_a_new_state_tensor_at_a_dead_ones_address_is_not_taken_for_it() -> None:
    """A tensor freed after a save may leave its ``id`` to a new one (CPython reuses
    addresses): the kept entry refers to the old one weakly, and is not reused for the new."""
    opt, params = _trained("sgd-momentum")
    kept = _kept_optim_tensors.kept_for(opt)
    optim.sharded_state_dict(opt, _model(params))
    old = opt.state[params[0]]["momentum_buffer"]
    new = old.clone()
    # The new tensor takes the old one's place and, as CPython may give it, its address.
    kept._kept[id(new)] = kept._kept.pop(id(old))
    opt.state[params[0]]["momentum_buffer"] = new
    del old
    gc.collect()
    second = optim.sharded_state_dict(opt, _model(params))
    assert (kept.made, kept.reused) == (1, 2)
    _check_is_megatrons(opt, _model(params), second)

"""A fast-tier load from the bytes the recovery checked: one copy of each tensor, into the tensor
it restores.

- ``safe_load.load_torch_file(data=..., share=True)``: the tensors are views of the bytes held
  (none copied), equal to what ``torch.load`` makes of the file; the pickle is checked first all
  the same (a file that would run code is refused, nothing runs); bytes it cannot share
  (read-only) are loaded the ordinary way;
- ``_rank_state._restore``: each saved tensor is copied into the template's tensor (the model's
  parameter, the optimizer's state), as Megatron-Core's load does; one it cannot take (another
  dtype or shape, none) gets a copy of its own; nothing returned shares the bytes held; a rank
  state that lacks a tensor changes nothing; the copy is the saved bytes exactly, whatever the
  dtype (one ``memcpy`` on the loading thread for contiguous host tensors, else ``copy_``);
- ``files.buffer``: the memory a copy is read or received into, writable, zeroed, equal to the
  bytes read into it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from _crafted import touching

from lightning_mcore_ckpt.engine import _rank_state
from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.safety import safe_load
from lightning_mcore_ckpt.safety.safe_load import UnsafeCheckpointError


def _saved(payload: Any) -> bytearray:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return bytearray(buffer.getvalue())


def _inside(tensor: torch.Tensor, data: Any) -> bool:
    base = torch.frombuffer(data, dtype=torch.uint8)
    return base.data_ptr() <= tensor.data_ptr() < base.data_ptr() + base.numel()


PAYLOAD = {
    "w": torch.randn(64, 32),
    "parts": [torch.arange(10), torch.tensor(3.5, dtype=torch.float64)],
    "view": torch.randn(100)[10:20],  # a view of a larger storage
    "name": "x",
}


@pytest.mark.parametrize("held", ["bytearray", "buffer", "received"])
def test_shared_tensors_are_views_of_the_bytes_held_equal_to_torch_loads(held: str) -> None:
    data: Any = _saved(PAYLOAD)
    if held == "buffer":  # what the recovery reads a copy into
        into = files.buffer(len(data))
        into[:] = data
        data = into
    elif held == "received":  # what a peer's copy arrives in
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy().data
    loaded = safe_load.load_torch_file(Path("state_00000.pt"), data=data, share=True)
    expected = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert loaded["name"] == "x"
    for key in ("w", "view"):
        assert torch.equal(loaded[key], expected[key]) and _inside(loaded[key], data)
    assert torch.equal(loaded["parts"][0], expected["parts"][0])
    assert loaded["parts"][1].dtype == torch.float64 and loaded["parts"][1].item() == 3.5


def test_without_share_or_from_read_only_bytes_the_tensors_are_copies() -> None:
    data = _saved(PAYLOAD)
    copied = safe_load.load_torch_file(Path("state_00000.pt"), data=data)
    assert torch.equal(copied["w"], PAYLOAD["w"]) and not _inside(copied["w"], data)
    read_only = safe_load.load_torch_file(Path("state_00000.pt"), data=bytes(data), share=True)
    assert torch.equal(read_only["w"], PAYLOAD["w"])


@pytest.mark.parametrize("trusted", [False, True])
def test_a_shared_load_checks_the_pickle_first_and_refuses_what_would_run_code(
    tmp_path: Path, trusted: bool
) -> None:
    marker = tmp_path / "ran"
    data = _saved({"version": 1, "x": touching(marker)})
    if trusted:  # the user trusts it as a whole: loaded as torch.load would
        safe_load.load_torch_file(Path("state_00000.pt"), data=data, share=True, trusted=True)
        assert marker.exists()
        return
    with pytest.raises(UnsafeCheckpointError, match=r"state_00000\.pt.*posix\.system"):
        safe_load.load_torch_file(Path("state_00000.pt"), data=data, share=True)
    assert not marker.exists()


def _template() -> tuple[dict[str, Any], torch.nn.Parameter, torch.Tensor]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    weight = torch.nn.Parameter(torch.zeros(4, 3))
    state = torch.empty(6)  # an optimizer's state, made to be loaded into
    template = {
        "w": ShardedTensor.from_rank_offsets("w", weight),
        "exp_avg": ShardedTensor.from_rank_offsets("exp_avg", state),
        "o": ShardedObject("o", None, (1,), (0,)),
    }
    return template, weight, state


def _part(template: dict[str, Any], tensors: dict[str, torch.Tensor], obj: Any) -> dict[str, Any]:
    tensor_id, object_id = _rank_state._shard_ids()
    return {
        "common": {"groups": [{"lr": 0.1}]},
        "tensors": {repr(tensor_id(template[k])): t for k, t in tensors.items()},
        "objects": {repr(object_id(template["o"])): obj},
        "keys": [],
    }


def test_each_saved_tensor_is_copied_into_the_tensor_it_restores() -> None:
    template, weight, state = _template()
    held = _saved({"w": torch.arange(12.0).reshape(4, 3), "s": torch.full((6,), 2.0)})
    saved = safe_load.load_torch_file(Path("state_00000.pt"), data=held, share=True)
    extra = torch.tensor([7, 8])
    part = _part(template, {"w": saved["w"], "exp_avg": saved["s"]}, {"extra": extra})
    out = _rank_state._restore(template, part, torch.device("cpu"))
    assert out["w"] is weight and out["exp_avg"] is state  # loaded in place
    assert torch.equal(weight.detach(), torch.arange(12.0).reshape(4, 3)) and weight.requires_grad
    assert torch.equal(state, torch.full((6,), 2.0))
    # An object is its own copy; nothing returned shares the bytes held.
    assert torch.equal(out["o"]["extra"], extra) and out["o"]["extra"] is not extra
    assert out["groups"] == [{"lr": 0.1}]
    assert not any(_inside(t, held) for t in (out["w"], out["exp_avg"], out["o"]["extra"]))


@pytest.mark.parametrize("saved", ["another dtype", "another shape"])
def test_a_tensor_the_template_cannot_take_as_it_is_gets_a_copy_of_its_own(saved: str) -> None:
    template, _, state = _template()
    value = torch.ones(6, dtype=torch.float64) if saved == "another dtype" else torch.ones(2, 3)
    held = _saved({"w": torch.ones(4, 3), "s": value})
    loaded = safe_load.load_torch_file(Path("state_00000.pt"), data=held, share=True)
    part = _part(template, {"w": loaded["w"], "exp_avg": loaded["s"]}, None)
    out = _rank_state._restore(template, part, torch.device("cpu"))
    assert out["exp_avg"] is not state and torch.equal(out["exp_avg"], value)
    assert out["exp_avg"].dtype == value.dtype and not _inside(out["exp_avg"], held)


def test_a_rank_state_that_lacks_a_tensor_changes_nothing() -> None:
    template, weight, _ = _template()
    part = _part(template, {"w": torch.ones(4, 3)}, None)  # no exp_avg
    with pytest.raises(KeyError, match="exp_avg"):
        _rank_state._restore(template, part, torch.device("cpu"))
    assert not weight.detach().any()  # the weight was not loaded either


@pytest.mark.parametrize("size", [0, 100, 3 << 20])
def test_a_buffer_is_writable_zeroed_and_equal_to_the_bytes_read_into_it(size: int) -> None:
    buffer = files.buffer(size)
    assert len(buffer) == size and not any(bytes(buffer))
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    memoryview(buffer)[:] = data
    assert buffer == data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_load_copies_the_bytes_exactly_whatever_the_dtype(dtype: torch.dtype) -> None:
    saved = (torch.randn(5, 7) * 100).to(dtype)
    target = torch.zeros(5, 7, dtype=dtype)
    assert _rank_state._into(target, saved, torch.device("cpu")) is target
    assert torch.equal(target.view(torch.uint8), saved.view(torch.uint8))
    scalar = torch.zeros((), dtype=dtype)  # a 0-dim tensor (a step count)
    _rank_state._into(scalar, saved[0, 0], torch.device("cpu"))
    assert torch.equal(scalar, saved[0, 0])
    strided = torch.zeros(7, 5, dtype=dtype).t()  # not contiguous: copied as torch copies
    _rank_state._into(strided, saved, torch.device("cpu"))
    assert torch.equal(strided, saved)

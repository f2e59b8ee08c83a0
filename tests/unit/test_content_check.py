"""``non_finite``: the floating tensors of a payload holding a NaN or an infinity, by name.

Axes: the value (NaN, +inf, -inf, +inf and -inf together, finite values whose sum overflows,
all finite) x the dtype (fp32, bf16, fp16, float64; integer tensors are never reported) x
where it sits (top level, nested dicts, lists, a large tensor past the first chunk)."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_ckpt.engine import non_finite

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_an_infinity_is_named_where_it_sits(dtype: torch.dtype, value: float) -> None:
    bad = torch.zeros(5, dtype=dtype)
    bad[3] = value
    payload = {"model": {"w": torch.ones(4, dtype=dtype), "b": [torch.zeros(2), bad]}}
    assert non_finite(payload) == ["model.b[1]"]


def test_opposite_infinities_and_a_nan_past_the_first_chunk_are_found() -> None:
    both = torch.tensor([float("inf"), float("-inf")])
    big = torch.zeros((1 << 22) + 10)
    big[-1] = float("nan")
    assert non_finite({"both": both, "big": big}) == ["both", "big"]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_finite_values_whose_sum_overflows_are_not_reported(dtype: torch.dtype) -> None:
    largest = torch.finfo(dtype).max
    assert non_finite({"w": torch.full((8,), largest, dtype=dtype)}) == []


def test_integer_tensors_and_other_values_are_never_reported() -> None:
    payload = {"step": torch.tensor(3), "ids": torch.arange(4), "name": "x", "lr": 0.1}
    assert non_finite(payload) == []


def test_at_most_limit_names() -> None:
    payload = {f"t{i}": torch.tensor([float("nan")]) for i in range(9)}
    assert non_finite(payload, limit=3) == ["t0", "t1", "t2"]

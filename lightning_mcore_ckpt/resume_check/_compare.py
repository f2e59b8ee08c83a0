"""Compare what two runs recorded and name the first divergence (pure logic, no torch).

A *timeline* is, per rank, the list of batch records a :class:`ResumeProbe` wrote (``loop``,
``data``, ``rng``, ``weights``, ``optimizer``, ``scheduler``, ``loss``). At each batch the
categories are checked in the order in which a cause shows up: the loop counters, the data, every
RNG stream, the state going into the batch (weights, optimizer, LR scheduler), and finally the
loss the batch produced. The first batch at which any category differs on any rank is the
divergence; what still agrees at that batch is reported too, since that is what tells a missing
RNG stream from a module attribute that was never saved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Divergence", "compare_finals", "compare_timelines", "describe_stream"]

Timeline = Sequence[Mapping[str, Any]]

_STATE = ("weights", "buffers", "optimizer", "scheduler")
_LABELS = {
    "loop": "loop counters",
    "data": "data order",
    "weights": "weights",
    "buffers": "model buffers (e.g. an MoE router's expert_bias)",
    "optimizer": "optimizer state",
    "scheduler": "LR scheduler state",
    "loss": "loss",
    "length": "number of batches",
}


def describe_stream(stream: str) -> str:
    """A reader's name for an RNG stream key of :func:`~._probe.rng_digests`."""
    if stream.startswith("megatron:"):
        name = stream.split(":", 1)[1]
        return f"Megatron-Core RNG tracker '{name}' (dropout)"
    if stream.startswith("cuda:"):
        return f"CUDA RNG of device {stream.split(':', 1)[1]}"
    return {"python": "Python RNG", "numpy": "NumPy RNG", "torch": "torch CPU RNG"}.get(
        stream, stream
    )


def _label(category: str) -> str:
    if category.startswith("rng:"):
        return describe_stream(category[4:])
    return _LABELS.get(category, category)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclass
class Divergence:
    """The first point at which a run differs from the reference.

    ``step`` is the optimizer step the batch belongs to (global step at its start + 1; ``None``
    for the state after the last step), ``differs`` maps each differing category (``"loop"``,
    ``"data"``, ``"rng:<stream>"``, ``"weights"``, ``"optimizer"``, ``"scheduler"``, ``"loss"``,
    ``"length"``) to the ranks where it differs; ``message`` says it in one line.

    Example::

        found = report.results[0].divergence
        if found is not None and "data" in found.differs:
            ranks = found.differs["data"]  # where the data order differs; found.detail says how
    """

    step: int | None
    epoch: int | None
    batch: int | None
    differs: dict[str, list[int]] = field(default_factory=dict)
    identical: list[str] = field(default_factory=list)
    message: str = ""
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch": self.batch,
            "differs": self.differs,
            "identical": self.identical,
            "message": self.message,
            "detail": self.detail,
        }


def _categories(record: Mapping[str, Any]) -> list[str]:
    rng = sorted(record.get("rng", {}))
    return ["loop", "data", *(f"rng:{s}" for s in rng), *_STATE, "loss"]


def _value(record: Mapping[str, Any], category: str) -> Any:
    if category.startswith("rng:"):
        return record.get("rng", {}).get(category[4:])
    return record.get(category)


def _hint(differs: Mapping[str, list[int]], first_resumed: bool) -> str:
    cats = set(differs)
    if cats == {"loss"}:
        return (
            " The loss differs although data, RNG, weights and optimizer state are identical: "
            "the module most likely keeps state that is not in the checkpoint (an attribute "
            "such as a counter, a curriculum position or an EMA). Save it in "
            "on_save_checkpoint and restore it in on_load_checkpoint."
        )
    if first_resumed and "data" in cats and "loop" not in cats:
        return (
            " The resumed run got other samples: the dataloader position or its shuffling "
            "state was not restored (use torchdata's StatefulDataLoader)."
        )
    if first_resumed and any(c.startswith("rng:") for c in cats):
        return " An RNG stream was not restored to the state it had at the save."
    return ""


def _divergence_at(
    expected: Mapping[int, Mapping[str, Any]],
    actual: Mapping[int, Mapping[str, Any]],
    first_resumed: bool,
) -> Divergence | None:
    differs: dict[str, list[int]] = {}
    anchor = next(iter(expected.values()))
    categories = _categories(anchor)
    for rank in sorted(expected):
        for category in categories:
            if _value(expected[rank], category) != _value(actual.get(rank, {}), category):
                differs.setdefault(category, []).append(rank)
    if not differs:
        return None
    loop = anchor.get("loop", {})
    step = loop.get("global_step")
    identical = [c for c in categories if c not in differs and not c.startswith("rng:")]
    if not any(c.startswith("rng:") for c in differs):
        identical.append("rng")
    parts = []
    for category in categories:
        if category in differs:
            parts.append(f"{_label(category)} differs on {_ranks(differs[category])}")
    same = [_label(c) for c in ("data", "weights", "optimizer") if c in identical]
    where = f"step {step + 1}" if step is not None else "the end"
    if loop.get("epoch") is not None and loop.get("batch", -1) >= 0:
        where += f" (epoch {loop['epoch']}, batch {loop['batch']})"
    message = f"{where}: " + "; ".join(parts)
    if same:
        message += "; " + ", ".join(same) + " identical"
    if "weights" not in differs and step is not None:
        message += "; weights identical until then"
    message += "." + _hint(differs, first_resumed)
    details = []
    for category, what in (("loop", "loop counters"), ("data", "samples")):
        if category in differs:
            rank = differs[category][0]
            details.append(
                f"rank {rank}: expected {what} {expected[rank].get(category)}, got "
                f"{actual.get(rank, {}).get(category)}"
            )
    detail = "; ".join(details)
    return Divergence(
        step=None if step is None else step + 1,
        epoch=loop.get("epoch"),
        batch=loop.get("batch"),
        differs=differs,
        identical=identical,
        message=message,
        detail=detail,
    )


def start_index(timeline: Timeline, resumed_from: int) -> int:
    """Index of the first batch of step ``resumed_from + 1`` in an uninterrupted timeline."""
    for i, record in enumerate(timeline):
        if record["loop"]["global_step"] == resumed_from:
            return i
    return len(timeline)


def compare_timelines(
    reference: Mapping[int, Timeline], run: Mapping[int, Timeline], resumed_from: int = 0
) -> Divergence | None:
    """The first batch at which ``run`` (which started at step ``resumed_from``) differs.

    ``reference`` is an uninterrupted run from step 0; both map a rank to its records.
    """
    ranks = sorted(reference)
    if sorted(run) != ranks:
        return Divergence(
            step=None,
            epoch=None,
            batch=None,
            differs={"length": sorted(set(ranks) ^ set(run))},
            message=f"ranks differ: the reference recorded {ranks}, the run {sorted(run)}.",
        )
    offset = start_index(reference[ranks[0]], resumed_from)
    expected_n = len(reference[ranks[0]]) - offset
    actual_n = len(run[ranks[0]])
    for j in range(min(expected_n, actual_n)):
        found = _divergence_at(
            {r: reference[r][offset + j] for r in ranks},
            {r: run[r][j] for r in ranks if j < len(run[r])},
            first_resumed=j == 0 and resumed_from > 0,
        )
        if found is not None:
            return found
    if expected_n != actual_n:
        step = resumed_from + 1
        return Divergence(
            step=None,
            epoch=None,
            batch=None,
            differs={"length": ranks},
            message=(
                f"from step {step} the uninterrupted run trained {expected_n} batches and this "
                f"run {actual_n}: every batch they both trained is identical, but one stopped "
                "early or trained more (loop counters, max_steps or epoch length not restored?)."
            ),
        )
    return None


def compare_finals(
    reference: Mapping[int, Mapping[str, Any]], run: Mapping[int, Mapping[str, Any]]
) -> Divergence | None:
    """Compare the state after the last step (weights, optimizer, scheduler, RNG, loop)."""
    if not reference:
        return None
    found = _divergence_at(
        {r: {**v, "loop": {**v["loop"], "batch": -1}} for r, v in reference.items()},
        {r: {**v, "loop": {**v["loop"], "batch": -1}} for r, v in run.items()},
        first_resumed=False,
    )
    if found is None:
        return None
    found.step = None
    found.message = "after the last step: " + found.message.split(": ", 1)[1]
    return found

"""``python -m benchmarks --scale-sim``: a save's coordination at 64, 256 and 1,024 simulated ranks.

No 1,024 processes: one process per rank count runs the real save path
(``CheckpointWriter.save``: our plan check, Megatron-Core's validation and planning, torch DCP's
local and global planning, the shard writes, DCP's finalisation and our seal) as one rank at a
time, on torch's fake process group (``FakeStore``, backend ``"fake"``: a group of ``world``
ranks whose collectives return at once) with Megatron-Core's ``parallel_state`` initialised on
it. The fake group alone hands every rank its own payload back ("every rank is me"), which
would give rank 0 the wrong global plan and metadata. So the collectives that carry data
(object gathers and broadcasts; tensor all-reduces, broadcasts and all-gathers) are **recorded
and replayed**: each rank in turn runs its saves, and what it sends is kept by call index; at
its ``k``-th collective a rank receives what the others sent at their ``k``-th from the same
line of code (a record made elsewhere is not its part). What a rank sends may depend on what it
received (the replicas' distribution over the data-parallel group, the optimizer keys'
agreement, then the plans and write results), so the passes over every rank repeat, each rank
answered by the ranks before it in the same pass and by the others from the pass before, until
every rank makes the same calls as in the pass before (:func:`simulate`). Rank 0 then builds
the real global plan and ``.metadata`` from every rank's real plan and write results, and seals
the real ``metadata.json`` (the other ranks' files in place: :class:`PeerFiles`).

Measured on rank 0 and the last rank in the last pass, per save: the collectives (count, names, bytes sent and
received, pickled), the planning phases (wall and CPU: the same wrappers as
``benchmarks/scale.py``), DCP's finalisation (the gather of write results and rank 0's
``.metadata``), the seal, and the metadata files of the step (rank 0). Saves: the first plans
from scratch; with cached plans (``ckpt_cache_plans=True``) Megatron-Core checks at the second
that the plans repeat and reuses them from the third, so the third is the cached figure.

What it cannot see: the network. Collectives cost nothing here: their latency, the skew
between ranks, the time payloads take to travel and the waits at rank 0 are absent; only their
count and bytes are measured, and the work of the ranks around them. Storage is this machine's
disk for one rank's files, not a parallel file system under 1,024 writers. One process runs
one rank at a time, so no contention for cores. ``--check`` runs the same saves on up to 8
real gloo ranks and compares.

The state is a GPT-shaped Megatron-Core sharded state dict built directly (the keys, shapes,
offsets and replica ids Megatron-Core's ``GPTModel`` gives: each layer a chunk of a stacked
key, tensor-parallel splits on the Megatron axes, layer norms and row-parallel biases
replicated over TP) with AdamW's moments, sharded the way Megatron-Core's models are over
``TP x PP x DP``: TP = 8 and PP = 4 at every rank count from 32 on, DP = world / 32
(data-parallel weak scaling: the model is fixed, more replicas), as Llama-3-70B-class runs are
laid out on 1,024 GPUs. Tensors are small: planning and metadata depend on the number of
chunks, not their bytes.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.scale import COLLECTIVES, SaveProbe

log = logging.getLogger(__name__)

WORLDS = (64, 256, 1024)
SAVES = 3
"""Per simulated rank: the first save plans afresh, the third reuses cached plans."""
AFRESH, CACHED = 0, SAVES - 1

# Collectives whose payload is a Python object: recorded and replayed.
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list")
# Collectives of tensors whose result a rank uses: replayed too.
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather")

# The phases timed on a replayed rank, besides those of benchmarks.scale.SaveProbe.
PHASES = ("plan_check_s", "planning_mcore_s", "validate_s", "distribute_s", "dcp_plan_s")


@dataclass(frozen=True)
class Layout:
    """How the simulated world is split, and the model's shape."""

    world: int
    tp: int
    pp: int
    layers: int = 16
    hidden: int = 64
    vocab: int = 512

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


def layout_for(world: int, tp: int | None = None, pp: int | None = None) -> Layout:
    """TP = 8, PP = 4 from 32 ranks on, DP the rest; smaller worlds take what divides them."""
    tp = tp or min(8, world)
    pp = pp or max(1, min(4, world // tp))
    if world % (tp * pp):
        raise ValueError(f"world {world}: not a multiple of TP {tp} x PP {pp}")
    return Layout(world, tp, pp)


# --- the state of one rank -------------------------------------------------------------------


def _layer_params(hidden: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """A GPT layer's parameters (local spec): name, global shape, tensor-parallel axis."""
    h, f = hidden, 4 * hidden
    return [
        ("input_layernorm.weight", (h,), None),
        ("input_layernorm.bias", (h,), None),
        ("self_attention.linear_qkv.weight", (3 * h, h), 0),
        ("self_attention.linear_qkv.bias", (3 * h,), 0),
        ("self_attention.linear_proj.weight", (h, h), 1),
        ("self_attention.linear_proj.bias", (h,), None),
        ("pre_mlp_layernorm.weight", (h,), None),
        ("pre_mlp_layernorm.bias", (h,), None),
        ("mlp.linear_fc1.weight", (f, h), 0),
        ("mlp.linear_fc1.bias", (f,), 0),
        ("mlp.linear_fc2.weight", (h, f), 1),
        ("mlp.linear_fc2.bias", (h,), None),
    ]


class RankModel(torch.nn.Module):
    """This rank's parameters of a GPT split ``TP x PP x DP``, and their Megatron-Core sharded
    state dict (:meth:`sharded_state_dict`)."""

    def __init__(self, layout: Layout, tp_rank: int, pp_rank: int, dp_rank: int) -> None:
        super().__init__()
        self.layout, self.tp_rank, self.dp_rank = layout, tp_rank, dp_rank
        # (state dict key, sharded key, parameter, TP axis, global layer or None)
        self.entries: list[tuple[str, str, torch.nn.Parameter, int | None, int | None]] = []
        per_stage = layout.layers // layout.pp
        h, v = layout.hidden, layout.vocab
        if pp_rank == 0:
            self._add("embedding.word_embeddings.weight", (v, h), 0, None)
        for local in range(per_stage):
            layer = pp_rank * per_stage + local
            for name, shape, axis in _layer_params(h):
                self._add(f"decoder.layers.{name}", shape, axis, layer)
        if pp_rank == layout.pp - 1:
            self._add("decoder.final_layernorm.weight", (h,), None, None)
            self._add("decoder.final_layernorm.bias", (h,), None, None)
            self._add("output_layer.weight", (v, h), 0, None)

    def _add(self, key: str, shape: tuple[int, ...], axis: int | None, layer: int | None) -> None:
        local = list(shape)
        if axis is not None:
            local[axis] //= self.layout.tp
        param = torch.nn.Parameter(torch.randn(local) * 0.02)
        name = key if layer is None else key.replace("decoder.layers.", f"decoder.layers.{layer}.")
        self.register_parameter(name.replace(".", "__"), param)
        self.entries.append((name, key, param, axis, layer))

    def sharded_state_dict(self) -> dict[str, Any]:
        """As Megatron-Core's ``GPTModel.sharded_state_dict()`` lays it out: each layer a chunk
        of the stacked key (a prepended layer axis), TP splits on their axis with replica id
        ``(0, 0, dp)``, TP-replicated tensors with ``(0, tp, dp)``."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out: dict[str, Any] = {}
        tp = self.layout.tp
        for name, key, param, axis, layer in self.entries:
            offsets: list[tuple[int, int, int]] = []
            prepend = 0
            if layer is not None:
                offsets.append((0, layer, self.layout.layers))
                prepend = 1
            if axis is not None:
                offsets.append((axis + prepend, self.tp_rank, tp))
                replica = (0, 0, self.dp_rank)
            else:
                replica = (0, self.tp_rank, self.dp_rank)
            out[name] = ShardedTensor.from_rank_offsets(
                key, param, *offsets, replica_id=replica, prepend_axis_num=prepend
            )
        return out


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over ``model`` with its state created (one step of zero gradients)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return optimizer


# --- the collectives, counted, recorded and replayed ----------------------------------------


class Collectives:
    """Wraps ``torch.distributed``'s collectives in this process (:meth:`install`, once).

    Every call is counted on :attr:`calls` (name, bytes sent, bytes received). On the fake
    group (``mode`` ``"record"`` or ``"replay"``) the collectives that carry data (objects,
    and the tensors of all-reduces, broadcasts and all-gathers) are answered here: this rank's
    payload is kept in :attr:`sent` under its call index, and the other ranks' parts are what
    they sent at the same index from the same call site, in :attr:`sent` for a lower rank (it
    ran before in this pass) and in :attr:`peers` for a higher one (``"replay"``), or this
    rank's own (``"record"``, or a rank not recorded: counted in :attr:`unrecorded`). ``mode``
    ``"real"``: a real group, only counted.
    """

    def __init__(self) -> None:
        self.mode = "real"
        self.rank = 0
        self.index = 0
        self.calls: list[tuple[str, int, int]] = []
        self.sent: dict[int, dict[int, Any]] = {}
        self.peers: dict[int, dict[int, Any]] = {}
        self.unrecorded = 0
        self.misses: list[tuple[int, int, str, str | None]] = []
        self.lenient = False
        """Whether Megatron-Core's sharding check lets a save go on (see
        ``_lenient_validation``)."""
        self.swallowed = 0
        self.history: dict[int, list[tuple[str, int, int]]] = {}
        """Every rank's calls in the last pass over it."""
        self._depth = 0
        self.site = ""
        """Where the collective being answered was called (file and line)."""
        self._originals: dict[str, Callable[..., Any]] = {}

    def start_rank(
        self,
        rank: int,
        mode: str,
        peers: dict[int, dict[int, Any]] | None = None,
        sent: dict[int, dict[int, Any]] | None = None,
    ) -> None:
        """Count (and answer) the collectives of ``rank`` from now on; what it sends goes to
        ``sent`` (default: :attr:`sent`), the others' parts come from ``peers``."""
        self.mode, self.rank, self.index = mode, rank, 0
        self.calls, self.unrecorded, self.misses = [], 0, []
        self.history[rank] = self.calls
        if sent is not None:
            self.sent = sent
        self.peers = self.sent if peers is None else peers
        self.sent[rank] = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            if hasattr(dist, name) and name not in self._originals:
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        me = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if me._depth:
                return fn(*args, **kwargs)
            me._depth += 1
            me.site = _call_site()
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                arguments = bound.arguments
                if me.mode != "real" and not arguments.get("async_op"):
                    if name in OBJECT_COLLECTIVES:
                        return me._objects(name, arguments)
                    if name in TENSOR_COLLECTIVES:
                        return me._tensors(name, arguments)
                result = fn(*args, **kwargs)
                me._count(name, arguments)
                return result
            finally:
                me._depth -= 1

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def _count(self, name: str, arguments: dict[str, Any]) -> None:
        """A real or tensor collective: its payload's bytes (received: what the call filled)."""
        sent = received = 0
        if name == "all_gather_object":
            sent = _pickled(arguments["obj"])
            received = sum(_pickled(o) for o in arguments["object_list"]) - sent
        elif name == "gather_object":
            sent = _pickled(arguments["obj"])
            gathered = arguments.get("object_gather_list") or []
            received = max(0, sum(_pickled(o) for o in gathered) - sent) if gathered else 0
        elif name == "broadcast_object_list":
            size = _pickled(arguments["object_list"])
            sent, received = (size, 0) if self._is_src(arguments) else (0, size)
        elif name == "all_gather":
            sent = _tensor_bytes(arguments["tensor"])
            received = _tensor_bytes(arguments["tensor_list"]) - sent
        elif name == "broadcast":
            size = _tensor_bytes(arguments["tensor"])
            sent, received = (size, 0) if self._is_src(arguments) else (0, size)
        else:
            for value in arguments.values():
                sent += _tensor_bytes(value)
            received = sent if name == "all_reduce" else 0
        self.calls.append((name, sent, received))
        self.index += 1

    def _is_src(self, arguments: dict[str, Any]) -> bool:
        import torch.distributed as dist

        return self._src(arguments) == dist.get_rank()

    @staticmethod
    def _src(arguments: dict[str, Any]) -> int:
        import torch.distributed as dist

        src = arguments.get("src")
        if src is None and arguments.get("group_src") is not None:
            src = dist.get_global_rank(arguments["group"], arguments["group_src"])
        return src or 0

    @staticmethod
    def _ranks(arguments: dict[str, Any]) -> list[int]:
        import torch.distributed as dist

        group = arguments.get("group")
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        return ranks or list(range(dist.get_world_size()))

    def _objects(self, name: str, arguments: dict[str, Any]) -> None:
        import torch.distributed as dist

        index, me = self.index, dist.get_rank()
        received = 0
        if name == "broadcast_object_list":
            payload = pickle.dumps(arguments["object_list"])
            if self._is_src(arguments):
                self.sent[self.rank][index] = (self._call(name), payload)
                sent = len(payload)
            else:
                theirs = self._peer(self._src(arguments), index, payload, name)
                arguments["object_list"][:] = pickle.loads(theirs)
                sent, received = 0, len(theirs)
        else:
            payload = pickle.dumps(arguments["obj"])
            self.sent[self.rank][index] = (self._call(name), payload)
            sent = len(payload)
            if name == "all_gather_object":
                out = arguments["object_list"]
            else:
                dst = arguments.get("dst")
                if dst is None and arguments.get("group_dst") is not None:
                    dst = dist.get_global_rank(arguments["group"], arguments["group_dst"])
                out = arguments.get("object_gather_list") if (dst or 0) == me else None
            if out is not None:
                # Only rank 0 reads the shard metadata gathered for its validation: elsewhere
                # it is counted, not decoded (decoding every rank's at every rank would make
                # the simulation's own cost grow as the square of the ranks).
                unread = me != 0 and _called_from("determine_global_metadata")
                for slot, rank in enumerate(self._ranks(arguments)):
                    theirs = payload if rank == me else self._peer(rank, index, payload, name)
                    received += 0 if rank == me else len(theirs)
                    out[slot] = None if unread and rank != me else pickle.loads(theirs)
        self.calls.append((name, sent, received))
        self.index += 1

    def _tensors(self, name: str, arguments: dict[str, Any]) -> None:
        """All-reduce, broadcast and all-gather of tensors, from the ranks' recorded inputs."""
        import torch.distributed as dist

        index, me = self.index, dist.get_rank()
        tensor = arguments["tensor"]
        mine = tensor.detach().clone()
        size = _tensor_bytes(tensor)
        sent, received = size, 0
        if name == "broadcast":
            if self._is_src(arguments):
                self.sent[self.rank][index] = (self._call(name), mine)
            else:
                tensor.copy_(self._peer(self._src(arguments), index, mine, name))
                sent, received = 0, size
        else:
            self.sent[self.rank][index] = (self._call(name), mine)
            ranks = self._ranks(arguments)
            parts = [mine if r == me else self._peer(r, index, mine, name) for r in ranks]
            # What the call filled, as counted on real ranks: an all-gather's other parts, an
            # all-reduce's result (a ring all-reduce moves about twice that, whatever the ranks).
            received = size * (len(ranks) - 1) if name == "all_gather" else size
            if name == "all_gather":
                for out, part in zip(arguments["tensor_list"], parts, strict=True):
                    out.copy_(part)
            else:
                tensor.copy_(_reduce(parts, arguments["op"]))
        self.calls.append((name, sent, received))
        self.index += 1

    def _peer(self, rank: int, index: int, mine: Any, name: str) -> Any:
        """What ``rank`` sent at its call ``index`` (this rank's ``mine`` where it is not
        recorded, or was another collective: a pass whose ranks took other paths).

        A rank that has already run in this pass (a lower one) is answered from this pass: what
        rank 0 merges from a gather and broadcasts (the optimizer keys' union) reaches the others
        in the pass it is made, not one pass later."""
        recorded = None
        if self.mode == "replay":
            latest = self.sent if rank < self.rank else self.peers
            recorded = latest.get(rank, {}).get(index)
        call = self._call(name)
        if recorded is None or recorded[0] != call:
            if self.mode == "replay":
                self.unrecorded += 1
                self.misses.append((index, rank, call, None if recorded is None else recorded[0]))
            return mine
        return recorded[1]

    def _call(self, name: str) -> str:
        """The collective being answered and where it was called from: a peer's record at the
        same index made elsewhere (a pass whose ranks took paths of other lengths, such as the
        optimizer keys' agreement: one collective more where the ranks' keys differ) is not
        its part, even where the collective is the same."""
        return f"{name} from {self.site}"


def _call_site() -> str:
    """The file and line that called the collective being answered (past the wrappers of
    ``benchmarks``: this module's and :class:`benchmarks.scale.SaveProbe`'s)."""
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _HERE:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_HERE = os.path.dirname(os.path.abspath(__file__))


def _called_from(function: str, depth: int = 8) -> bool:
    """Whether ``function`` is among the ``depth`` callers of the collective being answered."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _reduce(parts: list[torch.Tensor], op: Any) -> torch.Tensor:
    import torch.distributed as dist

    stacked = torch.stack(parts)
    if op == dist.ReduceOp.MAX:
        return stacked.max(dim=0).values
    if op == dist.ReduceOp.MIN:
        return stacked.min(dim=0).values
    if op == dist.ReduceOp.PRODUCT:
        return stacked.prod(dim=0)
    return stacked.sum(dim=0)


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - an unpicklable payload: not counted
        return 0


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


# --- one rank's saves ------------------------------------------------------------------------


def _lenient_validation(collectives: Collectives) -> None:
    """Megatron-Core's check of the sharding and torch DCP's of the global plan, failing only
    in a pass whose peers are right: in an earlier pass, rank 0's check of the others' (not
    yet right) shards is counted in ``collectives.swallowed`` and the save goes on, so that
    the pass records every call."""
    from megatron.core.dist_checkpointing import state_dict_utils, validation
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    check = validation.validate_sharding_integrity

    def validate(*args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except CheckpointingException:
            if not collectives.lenient:
                raise
            collectives.swallowed += 1
            return None

    for module in (validation, state_dict_utils, fully_parallel):
        if hasattr(module, "validate_sharding_integrity"):
            module.validate_sharding_integrity = validate  # type: ignore[attr-defined]

    from torch.distributed.checkpoint import default_planner

    check_plan = default_planner._validate_global_plan

    def validate_plan(*args: Any, **kwargs: Any) -> Any:
        errors = check_plan(*args, **kwargs)  # a list of errors (a bool in older torch)
        if errors in ([], True) or not collectives.lenient:
            return errors
        collectives.swallowed += 1
        return [] if isinstance(errors, list) else True

    default_planner._validate_global_plan = validate_plan


def _phase_probe(probe: SaveProbe) -> None:
    """Time DCP's finalisation and our seal too (the scale probe times the planning)."""
    from megatron.core.dist_checkpointing.strategies import state_dict_saver

    from lightning_mcore_ckpt.engine import _writer

    state_dict_saver.save_state_dict_async_finalize = probe.timed_phase(  # type: ignore[attr-defined]
        "dcp_finalize_s", state_dict_saver.save_state_dict_async_finalize
    )
    writer_cls = _writer.CheckpointWriter
    writer_cls._complete = probe.timed_phase("seal_s", writer_cls._complete)  # type: ignore[method-assign]


def rank_saves(
    rank: int,
    layout: Layout,
    root: Path,
    collectives: Collectives,
    probe: SaveProbe,
    count: int = SAVES,
) -> list[dict[str, Any]]:
    """This rank's ``count`` saves of its state under ``root`` (its process group and
    Megatron-Core's ``parallel_state`` already up): per save, its collectives and phases."""
    from megatron.core import parallel_state

    from lightning_mcore_ckpt.engine import CheckpointWriter, SaveOptions, TrainingState

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    torch.manual_seed(1000 * pp_rank + tp_rank)
    model = RankModel(layout, tp_rank, pp_rank, dp_rank)
    state = TrainingState(
        module=model,
        model_sharded_state_dict=model.sharded_state_dict,
        optimizers=[_adamw(model)],
        rank=rank,
        device=torch.device("cpu"),
        parallel_layout={"tensor": layout.tp, "pipeline": layout.pp, "data": layout.dp},
    )
    writer = CheckpointWriter(cache_plans=True, write_threads=2)
    saves = []
    try:
        for step in range(count):
            start = collectives.index
            path = root / f"global_step_{step}"
            if rank and collectives.mode != "real":  # made by rank 0, which runs at another time
                for sub in ("model", "optim", "extra"):
                    (path / sub).mkdir(parents=True, exist_ok=True)
            writer.save({"global_step": step, "epoch": 0}, path, SaveOptions(), state)
            record = probe.take()[-1]
            calls = collectives.calls[start:]
            saves.append(
                {
                    "collectives": len(calls),
                    "names": [name for name, _, _ in calls],
                    "sent_bytes": sum(s for _, s, _ in calls),
                    "received_bytes": sum(r for _, _, r in calls),
                    **{k: v for k, v in record.items() if k != "collectives"},
                }
            )
    finally:
        writer.close()
    return saves


def _step_metadata(step: Path) -> dict[str, int]:
    """Rank 0's files of a step other than shards and ``extra/``: the metadata, by name."""
    return {
        str(p.relative_to(step)): p.stat().st_size
        for p in sorted(step.rglob("*"))
        if p.is_file() and p.suffix != ".distcp" and p.relative_to(step).parts[0] != "extra"
    }


def _as_rank(rank: int, layout: Layout) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        create_gloo_process_groups=False,
    )


MAX_PASSES = 4
"""Replayed passes over every rank at most (they stop when every rank's collectives repeat)."""


class PeerFiles:
    """The other ranks' files of a step, in place before rank 0 seals it (the seal lists and
    digests every file of the step). Rank 0 runs first in a pass, before the others write:
    right after it creates a step directory, the files they wrote there in the pass before
    (the same names and sizes: the same state) are hard-linked in."""

    def __init__(self) -> None:
        self.source: Path | None = None

    def install(self) -> None:
        from lightning_mcore_ckpt.engine import _writer

        create = _writer.create_step_directories
        me = self

        def create_and_fill(path: Path, *args: Any, **kwargs: Any) -> Any:
            problem = create(path, *args, **kwargs)
            if problem is None and me.source is not None:
                me._link(me.source / Path(path).name, Path(path))
            return problem

        _writer.create_step_directories = create_and_fill  # type: ignore[attr-defined]

    @staticmethod
    def _link(source: Path, target: Path) -> None:
        if not source.is_dir():
            return
        for file in source.rglob("*"):
            relative = file.relative_to(source)
            if not file.is_file() or (
                relative.parts[0] == "extra" and file.name == "rank_00000.pt"
            ):
                continue
            if relative.parent == Path(".") or file.name.endswith(".metadata"):
                continue  # rank 0's own: markers, metadata
            if file.suffix == ".distcp" and file.name.startswith("__0_"):
                continue
            (target / relative.parent).mkdir(parents=True, exist_ok=True)
            os.link(file, target / relative)


def _pass(
    layout: Layout,
    where: Path,
    collectives: Collectives,
    probe: SaveProbe,
    *,
    mode: str,
    saves: int,
    peers: dict[int, dict[int, Any]],
) -> tuple[dict[int, dict[int, Any]], dict[str, Any]]:
    """Every rank in turn runs ``saves`` saves into ``where``: what each sent, by call index,
    and the figures of rank 0 and the last rank."""
    sent: dict[int, dict[int, Any]] = {}
    figures: dict[str, Any] = {"failed": {}}
    for rank in range(layout.world):
        _as_rank(rank, layout)
        collectives.start_rank(rank, mode, peers=peers, sent=sent)
        try:
            saved = rank_saves(rank, layout, where, collectives, probe, saves)
        except Exception as error:  # noqa: BLE001 - an early pass: the others' parts are not right
            figures["failed"][rank] = f"{type(error).__name__}: {error}"[:2000]
            saved = []
        probe.take()
        if rank in (0, layout.world - 1):
            figures[str(rank)] = {
                "saves": saved,
                "unrecorded": collectives.unrecorded,
                "misses": collectives.misses[:50],
            }
        if rank == 0 and saved:
            steps = [where / f"global_step_{s}" for s in range(saves)]
            figures["0"]["metadata"] = [_step_metadata(step) for step in steps]
        if rank % 256 == 255:
            print(f"   {where.name}: {rank + 1} of {layout.world} ranks", flush=True)
    return sent, figures


def _names(collectives: Collectives) -> dict[int, list[str]]:
    """Every rank's collectives in the last pass, by name."""
    return {rank: [name for name, _, _ in calls] for rank, calls in collectives.history.items()}


def simulate(layout: Layout, scratch: str) -> dict[str, Any]:
    """One rank count, in this process (see the module docstring). Returns the figures of
    rank 0 and the last rank.

    A first pass runs every rank's first save, each rank's peers answered with its own
    payloads: what a rank sends before it has received anything is right (its shard
    metadata). Each later pass runs every rank's saves with its peers answered from the pass
    before (a lower rank's from this pass), so one more step of every exchange is right each
    time; the passes stop when every rank called the same collectives as in the pass before (at
    most :data:`MAX_PASSES`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from lightning_mcore_ckpt import _cpu

    _cpu.install("cpu")
    root = Path(scratch)
    shutil.rmtree(root, ignore_errors=True)
    collectives = Collectives()
    collectives.install()
    _lenient_validation(collectives)
    files = PeerFiles()
    files.install()
    probe = SaveProbe()
    probe.install()
    _phase_probe(probe)
    out: dict[str, Any] = {"layout": asdict(layout) | {"dp": layout.dp}, "ranks": {}}
    started = time.perf_counter()
    try:
        collectives.lenient = True
        where = root / "pass0"
        sent, _ = _pass(layout, where, collectives, probe, mode="record", saves=1, peers={})
        previous: dict[int, list[str]] = {}
        converged = False
        for passes in range(1, MAX_PASSES + 1):
            collectives.swallowed = 0
            files.source, where = where, root / f"pass{passes}"
            sent, figures = _pass(
                layout, where, collectives, probe, mode="replay", saves=SAVES, peers=sent
            )
            shutil.rmtree(files.source, ignore_errors=True)
            names = _names(collectives)
            log.info(
                "%s, pass %d: %d rank(s) failed, %d sharding check(s) failed: %s",
                layout,
                passes,
                len(figures["failed"]),
                collectives.swallowed,
                {r: e[:300] for r, e in figures["failed"].items()},
            )
            converged = names == previous
            if converged and not figures["failed"] and not collectives.swallowed:
                break
            previous = names
        out["passes"] = passes + 1
        failed = figures.pop("failed")
        if not converged:
            failed[0] = "the ranks' collectives did not repeat from one pass to the next"
        if collectives.swallowed:
            failed[0] = f"Megatron-Core's sharding check failed {collectives.swallowed} time(s)"
        if failed:
            first = min(failed)
            raise RuntimeError(
                f"{layout}: {len(failed)} rank(s) still failed after {passes + 1} passes, "
                f"rank {first}: {failed[first]}"
            )
        out["converged"] = True
        out["record_s"] = time.perf_counter() - started
        out["ranks"] = figures
    finally:
        if dist.is_initialized():
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return out


def real_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of a real gloo run of the same saves (the check of the simulation)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from lightning_mcore_ckpt import _cpu

    _cpu.install("cpu")
    layout = Layout(**cfg["layout"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp
    )
    collectives = Collectives()
    collectives.install()
    probe = SaveProbe()
    probe.install()
    _phase_probe(probe)
    collectives.start_rank(rank, "real")
    root = Path(cfg["dir"])
    saves = rank_saves(rank, layout, root, collectives, probe)
    out: dict[str, Any] = {"rank": rank, "saves": saves}
    if rank == 0:
        out["metadata"] = [_step_metadata(root / f"global_step_{s}") for s in range(SAVES)]
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def simulate_in_subprocess(layout: Layout, scratch: Path, timeout: float = 3600) -> dict[str, Any]:
    """:func:`simulate` in a fresh process (a clean torch.distributed and Megatron-Core state)."""
    from lightning_mcore_ckpt.testing import run_distributed

    cfg = {"layout": asdict(layout), "dir": str(scratch)}
    env = {"OMP_NUM_THREADS": "1"}
    return run_distributed(_simulate_rank, 1, cfg, timeout=timeout, env=env)[0]


def _simulate_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    return simulate(Layout(**cfg["layout"]), cfg["dir"])


# --- figures ---------------------------------------------------------------------------------


def growth_exponent(worlds: list[int], values: list[float]) -> float | None:
    """The least-squares slope of ``log(value)`` on ``log(world)``: 0 constant, 1 linear."""
    points = [(math.log(w), math.log(v)) for w, v in zip(worlds, values, strict=True) if v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def summarise(world: int, sim: dict[str, Any]) -> dict[str, Any]:
    """One row of the table from :func:`simulate`'s figures."""
    row: dict[str, Any] = {"world": world, "layout": sim["layout"], "record_s": sim["record_s"]}
    for rank, figures in sim["ranks"].items():
        who = "first" if rank == "0" else "last"
        for label, index in (("afresh", AFRESH), ("cached", CACHED)):
            save = figures["saves"][index]
            row[f"{who}.{label}.collectives"] = save["collectives"]
            row[f"{who}.{label}.sent_bytes"] = save["sent_bytes"]
            row[f"{who}.{label}.received_bytes"] = save["received_bytes"]
            row[f"{who}.{label}.save_cpu_s"] = save.get("save_cpu_s")
            row[f"{who}.{label}.planning_cpu_s"] = save.get("plan_check_cpu_s", 0.0) + save.get(
                "planning_mcore_cpu_s", 0.0
            )
            for phase in (*PHASES, "dcp_finalize_s", "seal_s"):
                row[f"{who}.{label}.{phase}"] = save.get(phase, 0.0)
        row[f"{who}.unrecorded"] = figures["unrecorded"]
        if rank == "0":
            metadata = figures["metadata"][CACHED]
            row["metadata_bytes"] = sum(metadata.values())
            row["metadata_by_name"] = metadata
    return row


ROWS = (
    ("collectives per save, cached plans", "first.cached.collectives", 1),
    ("collectives per save, plans afresh", "first.afresh.collectives", 1),
    ("rank 0 receives per save, cached (KiB)", "first.cached.received_bytes", 1024),
    ("rank 0 receives per save, afresh (KiB)", "first.afresh.received_bytes", 1024),
    ("last rank receives per save, cached (KiB)", "last.cached.received_bytes", 1024),
    ("last rank sends per save, cached (KiB)", "last.cached.sent_bytes", 1024),
    ("planning CPU s, rank 0, cached", "first.cached.planning_cpu_s", 1),
    ("planning CPU s, rank 0, afresh", "first.afresh.planning_cpu_s", 1),
    ("planning CPU s, last rank, cached", "last.cached.planning_cpu_s", 1),
    ("planning CPU s, last rank, afresh", "last.afresh.planning_cpu_s", 1),
    ("DCP finalisation s, rank 0, cached", "first.cached.dcp_finalize_s", 1),
    ("seal s, rank 0, cached", "first.cached.seal_s", 1),
    ("metadata per step (KiB)", "metadata_bytes", 1024),
)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown rows: a figure per rank count, and its growth exponent."""
    rows = sorted(rows, key=lambda r: r["world"])
    worlds = [r["world"] for r in rows]
    lines = [
        "| per save | " + " | ".join(f"{w} ranks" for w in worlds) + " | growth exponent |",
        "|---|" + "---:|" * (len(worlds) + 1),
    ]
    for label, key, unit in ROWS:
        values = [r.get(key) for r in rows]
        cells = [_cell(v, unit) for v in values]
        known = [(w, float(v)) for w, v in zip(worlds, values, strict=True) if v is not None]
        slope = growth_exponent([w for w, _ in known], [v for _, v in known])
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {'-' if slope is None else f'{slope:.2f}'} |"
        )
    return lines


def _cell(value: Any, unit: int) -> str:
    if value is None:
        return "-"
    if unit == 1 and isinstance(value, int):
        return str(value)
    scaled = value / unit
    return f"{scaled:.0f}" if scaled >= 100 else f"{scaled:.3f}"


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """Issue 48's scale target, judged on the rows: (name, met, the figures)."""
    rows = sorted(rows, key=lambda r: r["world"])
    worlds = [r["world"] for r in rows]
    if len(rows) < 2:
        return [("scale targets", False, "need two or more rank counts")]
    checks = []
    counts = [r.get("first.cached.collectives") for r in rows]
    checks.append(
        (
            "collectives per save, cached plans, constant",
            len(set(counts)) == 1,
            " / ".join(str(c) for c in counts),
        )
    )
    for name, key in (
        ("metadata per step grows no faster than ranks", "metadata_bytes"),
        (
            "rank 0's planning CPU (cached) grows no faster than ranks",
            "first.cached.planning_cpu_s",
        ),
        (
            "rank 0's planning CPU (afresh) grows no faster than ranks",
            "first.afresh.planning_cpu_s",
        ),
        (
            "rank 0's receipts per save (cached) grow no faster than ranks",
            "first.cached.received_bytes",
        ),
    ):
        values = [float(r.get(key) or 0.0) for r in rows]
        slope = growth_exponent(worlds, values)
        ok = slope is not None and slope <= 1.05
        checks.append((name, ok, "exponent " + ("-" if slope is None else f"{slope:.2f}")))
    return checks


def check_rows(real: list[dict[str, Any]], sim: dict[str, Any]) -> list[str]:
    """The simulation against a real gloo run of the same world: per save, the collectives'
    names and bytes on rank 0 and the last rank, and rank 0's metadata files."""
    lines = ["| save | rank | figure | real | simulated |", "|---|---|---|---:|---:|"]
    last = len(real) - 1
    for rank, real_rank_figures in ((0, real[0]), (last, real[last])):
        simulated = sim["ranks"][str(rank)]["saves"]
        for index, (mine, theirs) in enumerate(
            zip(real_rank_figures["saves"], simulated, strict=True)
        ):
            for key in ("collectives", "sent_bytes", "received_bytes"):
                lines.append(f"| {index + 1} | {rank} | {key} | {mine[key]} | {theirs[key]} |")
            same = "same" if mine["names"] == theirs["names"] else "DIFFERENT"
            lines.append(f"| {index + 1} | {rank} | sequence of collectives | {same} | |")
    for name, size in real[0]["metadata"][CACHED].items():
        simulated_size = sim["ranks"]["0"]["metadata"][CACHED].get(name)
        lines.append(f"| {CACHED + 1} | 0 | `{name}` bytes | {size} | {simulated_size} |")
    return lines


def run(args: Any, machine: dict[str, Any], stem: str) -> int:
    """``--scale-sim``: a real gloo run of ``args.check`` ranks and its simulation, then every
    rank count of ``args.procs`` simulated; writes ``<out>/<stem>.json`` and ``.md``."""
    import datetime
    import json

    from lightning_mcore_ckpt.testing import run_distributed

    worlds = [int(p) for p in args.procs.split(",") if p]
    scratch = Path(args.dir).resolve() / "scale-sim"
    shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "kind": "scale-sim",
        "machine": machine,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": [],
        "raw": {},
    }

    def write() -> None:
        (out / f"{stem}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (out / f"{stem}.md").write_text(report(data))

    if args.check:
        world, tp, pp = (int(x) for x in args.check.split(","))
        layout = layout_for(world, tp, pp)
        print(f"== scale-sim: real check, {world} ranks (TP {tp}, PP {pp})", flush=True)
        cfg = {"layout": asdict(layout), "dir": str(scratch / "real")}
        real = run_distributed(real_rank, world, cfg, timeout=1800, env={"OMP_NUM_THREADS": "1"})
        sim = simulate_in_subprocess(layout, scratch / "check")
        data["check"] = {"layout": asdict(layout), "real": real, "simulated": sim}
        write()
    for world in sorted(worlds):
        layout = layout_for(world)
        started = time.perf_counter()
        print(f"== scale-sim: {world} ranks (TP {layout.tp}, PP {layout.pp}, DP {layout.dp})")
        sim = simulate_in_subprocess(layout, scratch / str(world))
        row = summarise(world, sim)
        row["elapsed_s"] = time.perf_counter() - started
        data["rows"].append(row)
        data["raw"][str(world)] = sim
        write()
        print(f"== scale-sim, {world} ranks: {row['elapsed_s']:.0f} s", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print(report(data))
    print(f"results: {out / stem}.json / .md")
    return 0


def report(data: dict[str, Any]) -> str:
    """The run's Markdown: the check against real ranks, the table, the targets."""
    lines: list[str] = []
    check = data.get("check")
    if check:
        layout = check["layout"]
        lines += [
            f"## Check: {layout['world']} real ranks (gloo) against their simulation "
            f"(TP {layout['tp']}, PP {layout['pp']})",
            "",
            *check_rows(check["real"], check["simulated"]),
            "",
        ]
    if data["rows"]:
        lines += ["## Simulated ranks (fake process group, recorded and replayed)", ""]
        lines += table(data["rows"])
        lines += ["", "```"]
        for name, ok, value in targets(data["rows"]):
            lines.append(f"{'MET ' if ok else 'MISSED'}  {name}  ({value})")
        lines += ["```", ""]
    return "\n".join(lines) + "\n"

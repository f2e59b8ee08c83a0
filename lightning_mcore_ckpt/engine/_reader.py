"""``CheckpointReader``: loads step directories into the current layout, whatever saved them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt import _compat, _cpu
from lightning_mcore_ckpt.engine import _param_groups, _rank_state
from lightning_mcore_ckpt.engine._collectives import broadcast, first_failure
from lightning_mcore_ckpt.engine._parallel_reader import load_strategy, views_readable
from lightning_mcore_ckpt.engine._records import LOADED_FROM_KEY
from lightning_mcore_ckpt.engine._shards import default_write_threads
from lightning_mcore_ckpt.engine._state_dicts import (
    TrainingState,
    distributed_optimizers,
    megatron_optimizer_metadata,
    optimizer_sharded_state_dict,
    to_module_keys,
)
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.format.layout import EXTRA_DIR, EXTRA_FORMAT_VERSION, MODEL_DIR, OPTIM_DIR
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.storage import object_store, store_views
from lightning_mcore_ckpt.training import optim as _optim
from lightning_mcore_ckpt.training import parallel as _parallel
from lightning_mcore_ckpt.training.rng import RNGState

__all__ = ["CheckpointReader", "holds_weights_only"]

log = logging.getLogger(__name__)


def holds_weights_only(path: Path) -> bool:
    """A step with weights and nothing to resume (no optimizer, no training state)."""
    metadata = markers.read_metadata(path) or {}
    return (
        not (path / OPTIM_DIR).is_dir()
        and not (path / EXTRA_DIR).is_dir()
        and metadata.get("contents", ["model"]) == ["model"]
    )


_UNSAFE = "unsafe: "
"""Tags a refusal shared by ``first_failure``, so that every rank raises it as one."""


class CheckpointReader:
    """Reads a step directory's ``model/``, ``optim/`` and ``extra/`` into this rank's state.

    Collective methods (every rank calls them, in the same order): :meth:`resolve` (rank 0
    resolves, then broadcasts), :meth:`check_extra` (each rank checks the ``extra/`` file it
    will read, and every rank learns of any refusal), :meth:`load_weights` and
    :meth:`load_optimizers` (the shard reads of Megatron-Core's dist-checkpointing).
    :meth:`load_extra` is local: each rank reads its own ``extra/`` file (rank 0's when the
    layout changed).

    Nothing is unpickled from a step before it was checked (see ``_safe_load``): a file that
    would import a type outside torch's ``weights_only`` allowlist is refused with
    ``UnsafeCheckpointError``. ``trusted=True`` (the user's choice, see
    ``_safe_load.trusted_by_user``) skips the checks and loads every pickle as torch would.
    """

    def __init__(
        self,
        *,
        parallel_load: bool = False,
        read_threads: int | None = None,
        verify_hashes: bool = False,
    ) -> None:
        self.parallel_load = parallel_load
        """Spread the reads across data-parallel ranks (CUDA only; ignored on CPU)."""
        self.read_threads = read_threads or default_write_threads()
        """Shard files each rank reads at once."""
        self.verify_hashes = verify_hashes
        """Re-hash every file the load reads, against the digests of its commit."""
        self.sources: dict[str, Any] = {}
        """The local tiers of object-store dirpaths, and their stores: a ``resolve_last``
        (how "last" is found, rank 0) and a ``store`` (where a step no longer here is read)."""
        self._checked_extra: dict[Path, Any] = {}
        """The ``extra/`` file :meth:`check_extra` checked by loading it, by path: the load's
        later reads of it (:meth:`_saved_stateless`, :meth:`load_extra`) take it from here."""
        self._unloaded: list[torch.optim.Optimizer] = []
        """The torch optimizers whose state this load created uninitialised, for the load to
        overwrite whole: emptied again if the load fails (see :meth:`one_load`)."""

    def resolve(
        self, checkpoint_path: Any, rank: int, reading: tuple[str, ...] | None = None
    ) -> Path:
        """The step directory ``checkpoint_path`` names (a step, or a directory of steps).

        Collective: rank 0 resolves it and every rank gets its answer (or the same
        ``FileNotFoundError``). Checks that it is a step directory this version can read, and
        undamaged in what the load reads (``reading``: contents; ``None``: all of it).
        """
        problem = resolved = None
        if rank == 0:
            try:
                resolved = self._resolve(checkpoint_path, reading)
            except FileNotFoundError as err:
                problem = str(err)
        resolved, problem = broadcast((resolved, problem))
        if problem is not None:
            raise FileNotFoundError(problem)
        # A step in an object store is read through a local view of it (every rank).
        path = (
            store_views.open_view(resolved, rank=rank)
            if object_store.is_url(resolved)
            else Path(resolved)
        )
        if rank == 0 and str(path) != str(checkpoint_path):
            log.info("resuming from %s", path)
        if not (path / MODEL_DIR).is_dir():
            raise FileNotFoundError(
                f"{path} is not a lightning-mcore-ckpt step directory: it has no {MODEL_DIR}/ "
                "(expected model/, optim/, extra/)"
            )
        layout.check_format(path)
        _compat.check_readable(path)
        return path

    def newest_step(self, checkpoint_path: Any) -> int | None:
        """The step ``checkpoint_path`` (a directory of steps, or its store) resolves to now,
        undamaged; ``None``: none (local: call it on one rank)."""
        try:
            found = self._resolve(checkpoint_path, None)
        except FileNotFoundError:
            return None
        return layout.step_number(Path(found.rstrip("/")))

    def _resolve(self, checkpoint_path: Any, reading: tuple[str, ...] | None) -> str:
        tier = self.sources.get(str(checkpoint_path))
        if tier is not None:  # a dirpath in an object store, with its local tier
            found = tier.resolve_last(reading, self.verify_hashes)
            if found is None:
                raise FileNotFoundError(f"no complete checkpoint in {checkpoint_path} or its store")
            return str(found)
        path = Path(checkpoint_path)
        tier = self.sources.get(str(path.parent))
        # e.g. "best", staged out; or any step of a node-local tier (a node holds its part)
        if tier is not None and (tier.node_local or not layout.is_complete(path)):
            return store_views.resolve_url(
                tier.store.child(path.name).url, reading, self.verify_hashes
            )
        if object_store.is_url(checkpoint_path):
            object_store.require_client("ckpt_path", str(checkpoint_path))
            return store_views.resolve_url(str(checkpoint_path), reading, self.verify_hashes)
        return str(layout.resolve_checkpoint(checkpoint_path, reading, self.verify_hashes))

    def _load_strategy(self, path: Path) -> Any:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        strategy = load_strategy(get_default_load_sharded_strategy(str(path)), self.read_threads)
        if self.parallel_load and parallel_state.get_data_parallel_world_size() > 1:
            if _cpu.parallel_load_supported():
                strategy = FullyParallelLoadStrategyWrapper(
                    strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
                )
            else:
                log.info("ckpt_parallel_load needs CUDA; loading without it on CPU")
        return strategy

    def check_extra(
        self,
        directory: Path,
        state: TrainingState,
        *,
        trusted: bool = False,
        held: Mapping[Path, Any] | None = None,
    ) -> None:
        """Refuse, on every rank, an ``extra/`` file that any rank may not unpickle (collective).

        Each rank loads the file it will read (as :meth:`load_extra` does, with
        ``weights_only=True``); a refusal on any rank is raised on every rank, naming the file.
        ``held``: files' bytes already read, by path (a fast-tier recovery's checked copies).
        """
        source = self._extra_source(directory, state.rank, held)
        error: _safe_load.UnsafeCheckpointError | None = None
        self._checked_extra = {}
        if source is not None and not trusted:
            try:
                payload = _safe_load.load_torch_file(source, data=(held or {}).get(source))
                self._checked_extra[source] = payload
            except _safe_load.UnsafeCheckpointError as err:
                error = err
        found = first_failure(None if error is None else str(error), state.rank, state.device)
        if error is not None:
            raise error
        if found is not None:
            raise _safe_load.UnsafeCheckpointError(f"{found[1]} (found on rank {found[0]})")

    @staticmethod
    def _extra_source(
        directory: Path, rank: int, held: Mapping[Path, Any] | None = None
    ) -> Path | None:
        """The ``extra/`` file this rank reads: its own, else rank 0's (the layout changed).
        Its own when ``held`` has its bytes (a fast-tier copy fetched from a peer is loaded
        from them while it is still being written into the directory)."""
        own = directory / f"rank_{rank:05d}.pt"
        if held is not None and own in held:
            return own
        if not directory.is_dir():
            return None
        return own if own.is_file() else directory / "rank_00000.pt"

    def check_shapes(
        self, model_dir: Path, state: TrainingState, *, trusted: bool = False
    ) -> list[str]:
        """Refuse, on every rank, a checkpoint whose tensors do not fit the model, before any
        is loaded (collective: each rank checks the keys it holds, and every rank learns of the
        first refusal): a tensor of another shape, or a tensor the model will restore that the
        step lacks. With ``LightningModule.strict_loading = False`` the missing ones are a
        partial load on purpose: their keys are returned (and logged) to be left as they are.
        """
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        index = _safe_dcp.read_dcp_metadata(model_dir, trusted=trusted)
        saved = {
            key: tuple(md.size)
            for key, md in index.state_dict_metadata.items()
            if hasattr(md, "size")
        }
        ssd = state.model_sharded_state_dict()
        apply_factories(ssd)
        missing: list[str] = []
        problem: str | None = None
        for sh in nested_values(ssd):
            if not isinstance(sh, ShardedTensor):
                continue
            want, got = tuple(sh.global_shape), saved.get(sh.key)
            if got is None:
                missing.append(sh.key)
            elif got != want and problem is None:
                problem = (
                    f"checkpoint {model_dir.parent} does not fit the model: {sh.key} has shape "
                    f"{list(got)} in the checkpoint but {list(want)} in the model; load it into "
                    "a model with the configuration it was saved with"
                )
        missing = sorted(set(missing))
        if missing and problem is None and state.strict:
            problem = (
                f"checkpoint {model_dir.parent} does not fit the model: it has no "
                f"{_keys(missing)}, which the model would restore; nothing was loaded. Load it "
                "into the model it was saved from (same attribute names and config), or load "
                "the rest on purpose and keep those tensors as the model initialised them: set "
                "`strict_loading = False` on the LightningModule"
            )
        found = first_failure(problem, state.rank, state.device)
        if found is not None:
            raise ValueError(
                found[1] if found[0] == state.rank else f"{found[1]} (rank {found[0]})"
            )
        if missing:
            log.warning(
                "rank %d: strict_loading=False: %s not in %s, left as initialised",
                state.rank,
                _keys(missing),
                model_dir.parent,
            )
        return missing

    def load_weights(self, path: Path, state: TrainingState, *, trusted: bool = False) -> None:
        """Load ``path``'s ``model/`` into ``state.module``, resharded (collective).

        Unless ``trusted``, its index and non-tensor objects are checked first (every rank
        reads the same files, so every rank raises the same refusal).
        """

        if not trusted:
            _safe_dcp.check_dist_checkpoint(path / MODEL_DIR)
        left_out = set(self.check_shapes(path / MODEL_DIR, state, trusted=trusted))

        loaded = self._sharded_load(
            _without_keys(state.model_sharded_state_dict(), left_out), path / MODEL_DIR, trusted
        )
        state.module.load_state_dict(to_module_keys(state.module, loaded), strict=state.strict)

    def load_optimizers(
        self, directory: Path, state: TrainingState, *, trusted: bool = False
    ) -> None:
        """Load an ``optim/`` directory into ``state.optimizers``, resharded (collective).

        Checked first unless ``trusted``, as in :meth:`load_weights`.
        """
        from megatron.core.optimizer import MegatronOptimizer

        if not trusted:
            _safe_dcp.check_dist_checkpoint(directory)

        model_ssd = state.model_sharded_state_dict()
        saved_keys: set[str] | None = None
        for opt in state.optimizers:
            if not isinstance(opt, MegatronOptimizer):
                if saved_keys is None:
                    with views_readable(checked=not trusted):  # its index, as the load's
                        saved_keys = _optim.saved_state_keys(directory)
                # State for exactly the parameters that had it when saved (not frozen ones).
                self._create_state(opt, model_ssd, saved_keys)
        for dist_opt in distributed_optimizers(state.optimizers):
            # Megatron reads the state's step count before loading into it, and then copies
            # every element of each moment: its state as a step makes it, not zeroed.
            if not dist_opt.optimizer.state:
                self._create_state(dist_opt.optimizer)
        metadata = self._optimizer_format(directory, state, trusted)
        # The torch optimizers' state was made from the saved keys just above: no agreement.
        template = optimizer_sharded_state_dict(
            state.optimizers, state.module, model_ssd, True, metadata, load_template=True
        )
        loaded = self._sharded_load(template, directory, trusted)
        saved_groups = loaded.pop(_param_groups.RECORD_KEY, None)
        if metadata["distrib_optim_sharding_type"] == "fully_reshardable":
            self._regroup(loaded, saved_groups, state)
        stateless = self._saved_stateless(directory.parent / EXTRA_DIR, state, trusted)
        _rank_state.apply_optimizer_state(state, loaded, stateless)
        self._unloaded = []  # every state this load created is loaded

    def _sharded_load(
        self, sharded_state_dict: dict[str, Any], directory: Path, trusted: bool
    ) -> dict[str, Any]:
        """Megatron-Core's load of ``directory`` into ``sharded_state_dict`` (collective), its
        index and objects checked unless ``trusted``.

        Without Megatron-Core's access-integrity check (``validate_access_integrity``): it
        all-gathers every rank's sharded tensors' metadata to every rank, so that rank 0 can
        check that the ranks' shards cover each tensor once. That checks the structure being
        loaded into, not the step; each rank reads exactly the shards its own sharded tensors
        name, whatever the others hold, and every save of a structure checks it (each plan made
        afresh, the first save's planned ahead included). At 1,024 ranks every rank would
        receive the metadata of all of them; and its refusal is raised on rank 0 alone."""
        from megatron.core import dist_checkpointing

        with views_readable(checked=not trusted):
            loaded: dict[str, Any] = dist_checkpointing.load(
                sharded_state_dict,
                str(directory),
                sharded_strategy=self._load_strategy(directory),
                validate_access_integrity=False,
            )
        return loaded

    @staticmethod
    def _regroup(loaded: dict[str, Any], saved: Any, state: TrainingState) -> None:
        """Give each live distributed optimizer group the saved group of its own parameters
        (:mod:`._param_groups`; collective). A step written before the record has the live
        structure (an expert-parallel change was refused before the load): Megatron-Core pairs
        its groups itself."""
        live = _param_groups.this_ranks_groups(state.optimizers, state.model_sharded_state_dict)
        if saved is None or live is None:
            return
        problem: str | None = None
        try:
            for name, groups in live.items():
                opt = state.optimizers[int(name.rsplit("_", 1)[1])]
                loaded[name] = _param_groups.regroup(loaded[name], opt, saved[name], groups)
        except (KeyError, ValueError) as err:
            problem = f"the optimizer state cannot be mapped onto this run's optimizer: {err}"
        found = first_failure(problem, state.rank, state.device)
        if found is not None:
            raise ValueError(found[1])

    def load_rank_state(
        self,
        step: Path,
        state: TrainingState,
        *,
        trusted: bool = False,
        held: Mapping[Path, Any] | None = None,
    ) -> None:
        """Load this rank's file of a fast-tier step (:mod:`~._rank_state`) into ``state``'s
        model and optimizers (local: each rank reads its own file, in the layout that saved
        it). Checked before it is unpickled unless ``trusted``, as every step is. ``held``: as
        for :meth:`check_extra` (the file is then not read again). A file that lacks what
        this run loads (saved by a run with another model or optimizer) is refused, naming
        it and the ways on."""
        held = held or {}
        path = step / _rank_state.state_name(state.rank)
        payload = _rank_state.read(path, trusted=trusted, data=held.get(path))
        stateless = self._saved_stateless(step / EXTRA_DIR, state, trusted, held)
        try:
            _rank_state.load(payload, state, stateless, self._create_state)
        except _rank_state.NotInRankState as err:
            raise ValueError(
                f"{path}: {err.args[0]}, which this run loads: the fast step was saved by a run "
                "with another model or optimizer. Resume from the persistent tier instead "
                "(fit(ckpt_path=<its global_step_N directory>)), or move the fast tier's steps "
                f"out of {step.parent} to start it afresh"
            ) from err
        self._unloaded = []  # every state this load created is loaded

    @staticmethod
    def _optimizer_format(
        directory: Path, state: TrainingState, trusted: bool = False
    ) -> dict[str, Any]:
        """What Megatron-Core's optimizers are told to load ``directory`` with: the metadata it
        was saved with (its sharding type), whatever this run saves with. A distributed
        optimizer state saved ``dp_reshardable`` loads only into the same tensor-, pipeline-,
        context- and expert-parallel sizes: another layout is refused here, naming the fix.
        Megatron-Core reads its record through torch DCP: its index and objects checked unless
        ``trusted`` (this runs before the directory's own check)."""
        from megatron.core import dist_checkpointing

        if not distributed_optimizers(state.optimizers):
            return megatron_optimizer_metadata(state.optimizer_sharding)
        with views_readable(checked=not trusted):
            saved = dist_checkpointing.load_content_metadata(str(directory)) or {}
        # The saved format, gathered the way this machine can.
        sharding = saved.get("distrib_optim_sharding_type", state.optimizer_sharding)
        metadata = {
            **megatron_optimizer_metadata(sharding),
            **{k: v for k, v in saved.items() if k == "chained_optim_avoid_prefix"},
        }
        saved_layout = (markers.read_metadata(directory.parent) or {}).get("parallel_layout")
        CheckpointReader._check_optimizer_layout(directory.parent, sharding, saved_layout, state)
        return metadata

    def check_optimizer_layout(
        self, path: Path, state: TrainingState, *, trusted: bool = False
    ) -> None:
        """Refuse, before any of the step is loaded, an optimizer state that cannot load into
        this run (collective: every rank calls it, and every rank raises the same refusal).

        From the step's ``metadata.json``: a distributed optimizer state saved
        ``dp_reshardable`` after a model-parallel change, or saved ``fully_reshardable``
        before this version recorded its parameter groups (:mod:`._param_groups`) after an
        expert-parallel change. From ``optim/``'s index: every tensor this run's optimizers
        will restore (each inner optimizer's moments and main parameters, dense and expert)
        must be in the step. A step whose record does not name its sharding type is checked
        when its optimizer is loaded (:meth:`load_optimizers`), from Megatron-Core's own record.
        An index or object that would run code is refused as ``UnsafeCheckpointError`` (read
        unchecked only when ``trusted``).
        """
        problem: str | None = None
        try:
            if distributed_optimizers(state.optimizers):
                record = markers.read_metadata(path) or {}
                sharding = record.get("optimizer_sharding")
                if sharding is not None:
                    saved_layout = record.get("parallel_layout")
                    self._check_optimizer_layout(path, sharding, saved_layout, state)
                self._check_optimizer_complete(path / OPTIM_DIR, state, trusted)
            self._check_torch_optimizers_complete(path / OPTIM_DIR, state, trusted)
        except ValueError as err:  # an UnsafeCheckpointError too: tagged, raised as one
            unsafe = isinstance(err, _safe_load.UnsafeCheckpointError)
            problem = f"{_UNSAFE if unsafe else ''}{err}"
        found = first_failure(problem, state.rank, state.device)
        if found is not None:
            why = found[1].removeprefix(_UNSAFE)
            error = _safe_load.UnsafeCheckpointError if found[1] != why else ValueError
            raise error(why if found[0] == state.rank else f"{why} (rank {found[0]})")

    def _check_optimizer_complete(
        self, directory: Path, state: TrainingState, trusted: bool
    ) -> None:
        """Raise, naming them, when tensors this rank's optimizers will restore are not in
        ``directory`` (``optim/``). Reads its index only; changes no live tensor (a fresh
        distributed optimizer's state is created as the load would create it)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import (
            ShardedObject,
            ShardedTensor,
            apply_factories,
        )

        for dist_opt in distributed_optimizers(state.optimizers):
            if not dist_opt.optimizer.state:  # the load copies every element of its state
                self._create_state(dist_opt.optimizer)
        metadata = self._optimizer_format(directory, state, trusted)
        template = optimizer_sharded_state_dict(
            state.optimizers, state.module, state.model_sharded_state_dict(), True, metadata
        )
        apply_factories(template)
        saved = set(_safe_dcp.read_dcp_metadata(directory, trusted=trusted).state_dict_metadata)
        missing = sorted(
            {
                sh.key if isinstance(sh, ShardedTensor) else sh.unique_key
                for sh in nested_values(template)
                if isinstance(sh, ShardedTensor | ShardedObject)
                and (sh.key if isinstance(sh, ShardedTensor) else sh.unique_key) not in saved
            }
        )
        if missing:
            raise ValueError(
                f"checkpoint {directory.parent}: its optimizer state has no {_keys(missing)}, "
                "which this run's optimizer would restore; nothing was loaded. Load it into the "
                "run that saved it, or load the weights only, on purpose, with a fresh optimizer "
                f"from step 0: MegatronStrategy(init_from={str(directory.parent)!r}) and fit "
                "without ckpt_path"
            )

    @staticmethod
    def _check_torch_optimizers_complete(
        directory: Path, state: TrainingState, trusted: bool
    ) -> None:
        """Raise, naming them, when a torch optimizer's state tensors are partly missing from
        ``directory`` (``optim/``): a parameter whose ``exp_avg`` is there and ``exp_avg_sq`` is
        not would otherwise fail inside Megatron-Core's load. From the index; changes nothing."""
        from megatron.core.optimizer import MegatronOptimizer

        torch_optimizers = [o for o in state.optimizers if not isinstance(o, MegatronOptimizer)]
        if not torch_optimizers or not directory.is_dir():
            return
        saved = set(_safe_dcp.read_dcp_metadata(directory, trusted=trusted).state_dict_metadata)
        model_ssd = state.model_sharded_state_dict()
        missing = sorted(
            {k for o in torch_optimizers for k in _optim.missing_state_keys(o, model_ssd, saved)}
        )
        if missing:
            raise ValueError(
                f"checkpoint {directory.parent}: its optimizer state has no {_keys(missing)}, "
                "which this run's optimizer would restore; nothing was loaded. Load the weights "
                "only, on purpose, with a fresh optimizer from step 0: "
                f"MegatronStrategy(init_from={str(directory.parent)!r}) and fit without ckpt_path"
            )

    @staticmethod
    def _check_optimizer_layout(
        path: Path, sharding: Any, saved_layout: dict[str, int] | None, state: TrainingState
    ) -> None:
        if sharding not in ("dp_reshardable", "fully_reshardable"):
            raise ValueError(
                f"checkpoint {path}: its distributed optimizer state has sharding "
                f"type {sharding!r}, which this version cannot load; load the weights only "
                "(a step without optim/) or save it again with an older version"
            )
        if sharding == "dp_reshardable" and saved_layout:
            differs = {
                name: (saved_layout.get(name), size)
                for name, size in state.parallel_layout.items()
                if name not in ("world_size", "data_parallel_size")
                and saved_layout.get(name, size) != size
            }
            if differs:
                what = ", ".join(f"{n}={a} saved, {b} now" for n, (a, b) in differs.items())
                raise ValueError(
                    f"checkpoint {path}: its distributed optimizer state was saved "
                    f"with ckpt_optimizer_sharding='dp_reshardable', which reshards across "
                    f"data-parallel sizes only ({what}); resume with the saving layout, or save "
                    "with MegatronStrategy(ckpt_optimizer_sharding='fully_reshardable') to "
                    "change layouts, or load the weights only, with a fresh optimizer from "
                    f"step 0: MegatronStrategy(init_from={str(path)!r}) and fit without ckpt_path"
                )
        ep = "expert_model_parallel_size"
        if (
            sharding == "fully_reshardable"
            and saved_layout
            and saved_layout.get(ep, 1) != state.parallel_layout.get(ep, 1)
            and "distributed_optimizer_parts" not in (markers.read_metadata(path) or {})
        ):
            raise ValueError(
                f"checkpoint {path}: its distributed optimizer state was saved at "
                f"{ep}={saved_layout.get(ep, 1)} by a version that did not record which "
                "parameters each inner optimizer held, so it cannot be mapped onto this run's "
                f"{ep}={state.parallel_layout.get(ep, 1)}; resume with the saving layout and "
                "save a step again, or load the weights only, with a fresh optimizer from step "
                f"0: MegatronStrategy(init_from={str(path)!r}) and fit without ckpt_path"
            )

    @contextlib.contextmanager
    def one_load(self) -> Iterator[None]:
        """Meanwhile, one load: each ``extra/`` file its checks loaded (:meth:`check_extra`)
        and each index they read (``safe_dcp.indexes_kept``) is unpickled once, for this load
        only: dropped when it ends, whichever way it ends. An optimizer whose state the load
        created uninitialised and did not load (the load failed) has none again: what a step
        of training would create, never memory no load wrote."""
        try:
            with _safe_dcp.indexes_kept():
                yield
        finally:
            for optimizer in self._unloaded:
                optimizer.state.clear()
            self._unloaded = []
            self.forget_checked()

    def _create_state(
        self,
        optimizer: torch.optim.Optimizer,
        model_ssd: Mapping[str, Any] | None = None,
        saved_keys: set[str] | None = None,
    ) -> None:
        """``optimizer``'s state for this load to overwrite whole: uninitialised (torch Adam and
        AdamW; see ``training.optim.init_state``), emptied again if the load fails."""
        _optim.init_state(optimizer, model_ssd, saved_keys, overwritten=True)
        self._unloaded.append(optimizer)

    def forget_checked(self) -> None:
        """Drop what :meth:`check_extra` kept for the load that called it (at the load's end,
        whichever way it ends)."""
        self._checked_extra = {}

    def _extra_payload(
        self, path: Path, trusted: bool, held: Mapping[Path, Any] | None = None
    ) -> Any:
        """An ``extra/`` file's contents: as :meth:`check_extra` loaded it in this load, else
        loaded (checked unless ``trusted``; from ``held``'s bytes when it has them)."""
        if path in self._checked_extra:
            return self._checked_extra[path]
        return _safe_load.load_torch_file(path, trusted=trusted, data=(held or {}).get(path))

    def _saved_stateless(
        self,
        extra: Path,
        state: TrainingState,
        trusted: bool,
        held: Mapping[Path, Any] | None = None,
    ) -> list[list[int]] | None:
        # This rank's record, when the layout is the one that saved it.
        own = extra / f"rank_{state.rank:05d}.pt"
        if own not in (held or {}) and own not in self._checked_extra and not own.is_file():
            return None
        payload = self._extra_payload(own, trusted, held)
        if payload.get("parallel_layout") != state.parallel_layout:
            return None
        return payload.get("optimizer_stateless")

    def load_extra(
        self,
        directory: Path,
        state: TrainingState,
        *,
        seed: int,
        trusted: bool = False,
        held: Mapping[Path, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Lightning's state and the RNG from an ``extra/`` directory (local).

        Restores the RNG (this rank's file, when the layout is the one that saved it), else
        re-derives it from ``seed`` and the saved step. Returns Lightning's checkpoint dict (with
        :data:`LOADED_FROM_KEY`) and the RNG state as loaded, to re-apply at the first resumed
        batch; ``({}, None)`` when there is no ``extra/``. Loaded with ``weights_only=True``
        unless ``trusted`` (see :meth:`check_extra`, and for ``held``).
        """
        source = self._extra_source(directory, state.rank, held)
        if source is None:
            log.warning("%s is missing: loops, callbacks and RNG start fresh", directory)
            return {}, None
        own = directory / f"rank_{state.rank:05d}.pt"
        payload = self._extra_payload(source, trusted, held)
        version = payload.get("version", EXTRA_FORMAT_VERSION)
        if isinstance(version, int) and version > EXTRA_FORMAT_VERSION:
            raise ValueError(
                f"{source} is in extra-state format {version}; this lightning-mcore-ckpt reads "
                f"format {EXTRA_FORMAT_VERSION} and older. Upgrade lightning-mcore-ckpt to load it"
            )
        if isinstance(version, int) and version < 2 and state.rank == 0:
            log.warning(
                "%s is in extra-state format %d, which keeps NumPy's RNG state as a pickled "
                "array: it is read with NumPy's array types allowed (they run no code). Steps "
                "saved from now on are in format %d, whose own state needs nothing beyond "
                "torch's weights_only allowlist",
                directory.parent,
                version,
                EXTRA_FORMAT_VERSION,
            )
        saved_layout = payload.get("parallel_layout")
        lightning = dict(payload.get("lightning", {}))
        if saved_layout == state.parallel_layout and source == own:
            RNGState().load_state_dict(payload.get("rng", {}))
        else:
            step = int(lightning.get("global_step", 0))
            if state.rank == 0:
                log.warning(
                    "parallel layout changed since the save (%s -> %s): RNG is re-derived per "
                    "rank from seed=%d + global_step=%d instead of restored",
                    saved_layout,
                    state.parallel_layout,
                    seed,
                    step,
                )
            _parallel.seed_all(seed + step)
        lightning[LOADED_FROM_KEY] = {
            "path": str(directory.parent),
            "parallel_layout": saved_layout,
        }
        # Creating the resumed dataloader's iterator draws from the global RNG, which the
        # uninterrupted run did at the start of the epoch: the strategy re-applies this state
        # at the first resumed batch when it falls inside an epoch.
        return lightning, RNGState().state_dict()


def _keys(keys: list[str], shown: int = 5) -> str:
    """``keys`` named for a message: the first few, and how many more."""
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"tensor{'s' if len(keys) > 1 else ''} " + ", ".join(map(repr, keys[:shown])) + more


def _without_keys(sharded_state_dict: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """``sharded_state_dict`` without the sharded tensors of ``keys`` (a partial load)."""
    if not keys:
        return sharded_state_dict
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def keep(value: Any) -> bool:
        return not (isinstance(value, ShardedBase) and value.key in keys)

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if keep(v)}
        return value

    return strip(sharded_state_dict)

"""The fast tier during one ``fit``: found and checked at setup, saved on its cadence, its
outcomes logged, and the recovery that ``ckpt_path="last"`` runs through the strategy.

:class:`FastTierRun` is made by ``MegatronCheckpoint.setup`` when a
:class:`~lightning_mcore_ckpt.FastTier` is configured. At setup it learns which ranks share a
node by looking at the fast tier's directory (:func:`~.nodes.probe_sharing`), refuses what
cannot hold (ranks of one host that see different directories, uneven nodes, more replicas than
other nodes), and opens the tier's own process group. Rank 0 records every fast save and
recovery in the persistent tier (:class:`~.fast_records.FastRecords`).
It registers itself with the strategy as the source of ``"last"``: the strategy's load asks it
(:meth:`FastTierRun.recover`) which tier and which step to read.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_mcore_ckpt.callback.fast_records import RECORDS, FastRecords
from lightning_mcore_ckpt.callback.nodes import Sharing, probe_sharing
from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.fast.peers import Data, NodeMap
from lightning_mcore_ckpt.fast.recovery import Recovery, recover
from lightning_mcore_ckpt.fast.writer import FastSave, FastWriter
from lightning_mcore_ckpt.format import metrics

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.engine import TrainingState
    from lightning_mcore_ckpt.fast import FastTier

__all__ = ["RECORDS", "FastTierRun"]

log = logging.getLogger(__name__)


class FastTierRun:
    """The fast tier of one ``fit`` (see the module). :meth:`setup`, :meth:`save`,
    :meth:`recover` and :meth:`finish` are collective; :meth:`report` and :meth:`close` local."""

    def __init__(
        self,
        trainer: pl.Trainer,
        config: FastTier,
        writer: FastWriter,
        persistent_last: Callable[[], int | None],
        records: FastRecords,
        persistent: str,
    ) -> None:
        self.config = config
        self.writer = writer
        self.recovery: Recovery | None = None
        self._fetched: Recovery | None = None
        """The recovery whose copies fetched from peers may still be being written."""
        self._trainer = trainer
        self._persistent_last = persistent_last
        self._records = records
        self._persistent = persistent
        self._failed = 0

    @classmethod
    def setup(
        cls,
        trainer: pl.Trainer,
        config: FastTier,
        persistent_last: Callable[[], int | None],
        records: FastRecords,
        persistent: str,
    ) -> FastTierRun:
        """Find the nodes, check them against ``config``, open the tier (collective).
        ``persistent_last``: the persistent tier's newest step (rank 0); ``records``: where
        rank 0 adds the records of :data:`RECORDS`; ``persistent``: the path that loads the
        persistent tier's last."""
        import torch.distributed as dist

        root = config.root
        root.mkdir(parents=True, exist_ok=True)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and dist.get_world_size() > 1:
            sharing = probe_sharing(trainer, root)
            _check_hosts(config, sharing)
            nodes = NodeMap.from_leaders(sharing.leaders)
        else:
            nodes = NodeMap(((trainer.global_rank,),))
        _check_nodes(config, nodes)
        group = None
        if distributed:
            # At most the strategy's timeout: a silent node ends the job within that bound.
            timeout = datetime.timedelta(seconds=config.timeout_s)
            bound = getattr(trainer.strategy, "config", None)
            if bound is not None and hasattr(bound, "timeout"):
                timeout = min(timeout, bound.timeout)
            group = dist.new_group(backend="gloo", timeout=timeout)
        world = dist.get_world_size() if distributed else 1
        writer = FastWriter(config, nodes, trainer.global_rank, world, group)
        run = cls(trainer, config, writer, persistent_last, records, persistent)
        trainer.strategy.checkpoint_sources[str(root)] = run  # type: ignore[attr-defined]
        if trainer.is_global_zero:
            log.info(
                "fast tier: %s on %d node(s), every %d steps, %d cop%s per rank on other nodes",
                root,
                nodes.size,
                config.every_n_train_steps,
                config.replicas,
                "y" if config.replicas == 1 else "ies",
            )
        return run

    # --- saves ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step > 0 and step % self.config.every_n_train_steps == 0

    def save(self, trainer: pl.Trainer) -> None:
        """A fast save of the current step (collective; the write goes on in the background).
        The first one settles the recovery's fetched copies first (:meth:`settle`)."""
        self.settle()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state = trainer.strategy._training_state()  # type: ignore[attr-defined]
        self.writer.save(trainer.global_step, state, checkpoint)

    def report(self, wait: bool = False) -> None:
        """Log the fast saves that finished (``wait``: the one in flight too)."""
        if wait:
            self.writer.wait()
        for outcome in self.writer.poll():
            self._report(outcome)

    def _report(self, outcome: FastSave) -> None:
        trainer = self._trainer
        if not outcome.complete:
            self._failed += 1
            if trainer.is_global_zero:
                log.warning(
                    "fast step %d does not count (%d so far); training goes on: %s",
                    outcome.step,
                    self._failed,
                    "; ".join(outcome.errors),
                )
        if not trainer.is_global_zero:
            return
        figures = outcome.metrics() if outcome.complete else {}
        figures["checkpoint/fast_failed"] = float(self._failed)
        metrics.log_save_metrics(trainer.loggers, outcome.step, figures)
        self._records.append(
            {
                "kind": "fast_save",
                "step": outcome.step,
                "complete": outcome.complete,
                **{k.split("/", 1)[1]: v for k, v in outcome.metrics().items()},
                "copied_bytes": outcome.copied_bytes,
                "errors": list(outcome.errors),
            }
        )

    # --- recovery -------------------------------------------------------------------------

    def recover(self, state: TrainingState, *, keep: bool = False) -> tuple[str, Path] | None:
        """Which tier and step ``ckpt_path="last"`` loads (collective, from the strategy's
        load): ``("fast", step directory)``, ``("persistent", its directory)``, or ``None``
        when neither tier holds a step. ``keep``: the caller loads this rank's files from the
        bytes the recovery checked (:meth:`take_held`), not from the directory."""
        import torch.distributed as dist

        newest = self._persistent_last() if state.rank == 0 else None
        if dist.is_available() and dist.is_initialized():
            box = [newest]
            dist.broadcast_object_list(box, 0)
            newest = box[0]
        writer = self.writer
        self._settled()  # a recovery before (none in a run that loads once)
        self.recovery = self._fetched = found = recover(
            writer.root,
            writer.nodes,
            state.rank,
            self.config.replicas,
            newest,
            writer.group,
            dict(state.parallel_layout),
            check_finite=self.config.check_finite,
            keep=keep,
            timeout_s=self.config.timeout_s,
        )
        if state.rank == 0:
            self._announce(found, newest)
            self._records.append({"kind": "recovery", **found.record(), "persistent_step": newest})
        if found.directory is not None:
            return "fast", found.directory
        return None if newest is None else ("persistent", Path(self._persistent))

    def take_held(self) -> dict[str, Data] | None:
        """This rank's own files of the fast step just recovered with ``keep``, by their names
        in the step, as they matched their seal: the load uses these bytes and reads none of
        the files again. Handed over once (then ``None``): the memory goes with the load."""
        found = self.recovery
        if found is None or found.held is None:
            return None
        held, found.held = found.held, None
        return held.named()

    def settle(self, *, together: bool = True) -> None:
        """Wait for this rank's copies fetched from a peer at the recovery to be written into
        its node's directory (collective with ``together``, see :meth:`Recovery.settle`).

        Training does not wait for them: the state was loaded from the bytes received, checked
        against their seals (:meth:`take_held`), their write started as training did
        (:meth:`log_recovery`, not beside the load), and until the first fast save the step's
        copies on the holders' nodes are where a failure would resume from (retention runs
        at a fast save only). So the first fast save settles them, before it writes anything
        (and :meth:`close`, for a run that ends before one). A write that failed is logged on
        every rank (that node holds no copy of those files until that save writes the next
        step)."""
        found, self._fetched = self._fetched, None
        if found is None:
            return
        problem = found.settle(self.writer.group, together=together)
        if problem is not None and together and self._trainer.is_global_zero:
            log.warning(
                "fast tier: a copy fetched at the recovery could not be written: %s", problem
            )

    def _announce(self, found: Recovery, newest: int | None) -> None:
        for why in found.skipped:
            log.warning("fast tier: %s", why)
        if found.step is not None:
            log.info(
                "resuming fast step %d from %s (%d rank(s) from a peer node's copy)",
                found.step,
                found.directory,
                found.from_peers,
            )
        elif found.skipped:
            where = f"persistent step {newest}" if newest is not None else "scratch (no step)"
            log.warning("no fast step can be resumed: resuming from %s", where)
        elif newest is not None:
            log.info("resuming persistent step %d: no fast step is newer", newest)

    def log_recovery(self) -> None:
        """Log how the resume was served (rank 0), and start writing the copies fetched from
        peers into this node's directory: once training runs, its state loaded."""
        if self._fetched is not None:
            self._fetched.start_writes()
        found, self.recovery = self.recovery, None
        if found is not None:
            found.held = None  # not taken by the load: its memory goes now
        if found is None or not self._trainer.is_global_zero:
            return
        step = found.step if found.step is not None else self._trainer.global_step
        metrics.log_save_metrics(
            self._trainer.loggers,
            step,
            {
                "checkpoint/recovery_time_s": found.time_s,
                "checkpoint/recovered_from_fast_tier": float(found.step is not None),
                "checkpoint/recovered_ranks_from_peers": float(found.from_peers),
            },
        )

    def _settled(self) -> None:
        """The recovery's writes joined on this rank alone (no collective: for paths where
        the ranks may not all be here)."""
        if self._fetched is not None and self._fetched.writing:
            self.settle(together=False)

    def close(self, wait: bool = True) -> None:
        self._settled()
        self.writer.close(wait)
        sources = self._trainer.strategy.checkpoint_sources  # type: ignore[attr-defined]
        if sources.get(str(self.config.root)) is self:
            del sources[str(self.config.root)]


def _check_hosts(config: FastTier, sharing: Sharing) -> None:
    """Every rank of a host must see one directory at ``dir``: else each directory counts as a
    node, and a copy meant for another node may land on the same host (lost with it)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(sharing.hosts):
        by_host.setdefault(host, []).append(rank)
    split = {
        h: ranks for h, ranks in by_host.items() if len({sharing.leaders[r] for r in ranks}) > 1
    }
    if not split:
        return
    host, ranks = next(iter(split.items()))
    seen: dict[int, list[int]] = {}
    for rank in ranks:
        seen.setdefault(sharing.leaders[rank], []).append(rank)
    directories = "; ".join(
        f"{_ranks(group)}: {', '.join(sorted({repr(sharing.paths[r]) for r in group}))}"
        for group in seen.values()
    )
    more = f" (and {len(split) - 1} other host(s) alike)" if len(split) > 1 else ""
    given = repr(str(config.dir)) if len(set(sharing.paths)) == 1 else "..."  # one per rank
    raise ConfigurationError(
        f"FastTier(dir={given}): {_ranks(ranks)} run on host {host!r}{more} but see "
        f"{len(seen)} different directories there ({directories}), so each directory would "
        "count as a node of its own, and a copy meant for another node could land on this "
        "same host and be lost with it. Give every rank of a host the same directory: one "
        "path for every rank (no rank, process or container id in it), on a disk all of the "
        "host's ranks see (a host directory mounted into every container, not each "
        "container's own /dev/shm). If these are different machines reporting the same host "
        "name, give each machine its own host name"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _check_nodes(config: FastTier, nodes: NodeMap) -> None:
    if not nodes.uniform():
        counts = [len(n) for n in nodes.nodes]
        raise ConfigurationError(
            f"FastTier(dir={str(config.dir)!r}): the nodes run different numbers of ranks "
            f"({counts}); the fast tier pairs each rank with the same rank of its peer nodes. "
            "Run the same number of ranks on every node"
        )
    if config.replicas >= nodes.size:
        raise ConfigurationError(
            f"FastTier(replicas={config.replicas}): each copy goes to another node, and this "
            f"run has {nodes.size} node(s) seeing separate directories at {str(config.dir)!r}; "
            f"pass replicas <= {nodes.size - 1} (0 keeps the node's own copy only), or give "
            "each node its own directory there (a node-local disk)"
        )

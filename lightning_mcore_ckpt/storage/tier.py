"""The ``Tier`` interface: one place a ``dirpath``'s steps live.

A step is committed in three phases, in this vocabulary everywhere:

1. **write**: every rank writes its files into the local directory (the strategy, through
   :class:`~lightning_mcore_ckpt.engine.CheckpointWriter`). Where that directory is node-local
   (nodes that share no file system), each node holds its part of the step, which its leader
   hands to the tier (:meth:`Tier.part_upload`) and rank 0 gathers (:meth:`Tier.gather_parts`);
2. **seal**: once every rank has written, one process makes the step durable and writes its
   commit marker, ``metadata.json`` (:func:`lightning_mcore_ckpt.storage.seal.seal_step`);
3. **publish**: each tier, innermost first, makes the sealed step its own, so that its
   ``"last"`` may name it (:meth:`Tier.publish`).

A ``dirpath``'s tiers are ordered, innermost first: the local directory tier
(:class:`~lightning_mcore_ckpt.storage.local_tier.LocalTier`: the tracker), then each tier a
step is published to (:class:`~lightning_mcore_ckpt.storage.store_tier.StoreTier`: an object
store). The last is the persistent tier: retention and ``"last"`` go by its steps, and a step
leaves it first. The committer (``callback/_commit.py``) calls tiers through this interface
only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lightning_mcore_ckpt.format.layout import StepDir

__all__ = ["Tier"]


class Tier(Protocol):
    """One place a ``dirpath``'s steps live (see the module's docstring for the phases).

    Steps are named by their path in the local directory (Lightning's names), in every tier.
    Every method but :meth:`register` and :meth:`has_last` runs on rank 0 (publication and
    retention on the commit thread).
    """

    @property
    def where(self) -> str:
        """What messages name: the directory, or the store's URL."""

    @property
    def awaited(self) -> bool:
        """Whether a step's commit waits for its publication here (a failed publication fails
        the save); otherwise the publication is a job of its own, reported after the commit."""

    # --- a run's hold on the tier ---------------------------------------------------------

    def acquire(self) -> None:
        """Rank 0, when a ``fit`` starts: take the tier's lock (raises when another run holds
        it), and keep it alive."""

    def release(self) -> None:
        """Release what :meth:`acquire` took (a no-op when nothing is held)."""

    def register(self, sources: dict[str, Any]) -> None:
        """Every rank, at setup: add to ``sources`` (the strategy's ``checkpoint_sources``)
        what a load needs to find steps that are not in the local directory."""

    # --- a step's commit (rank 0) ----------------------------------------------------------

    def before_write(self, target: Path, overwrite: bool) -> str | None:
        """Before ``target`` is written: ``"exists"`` (it is complete here: not written
        again), why it may not be written, or ``None``. May clear what a failed save left."""

    def gather_parts(
        self, target: Path, hashes: Mapping[str, str]
    ) -> dict[str, tuple[int, str]] | None:
        """Rank 0, the commit thread, before the seal: the files of ``target`` written on other
        nodes (a node-local directory that this process cannot read), each with its size and
        digest once its node confirmed them; ``None`` when every file is in the local
        directory. ``hashes``: the digests every rank recorded while writing."""

    def part_upload(self, target: Path, hashes: Mapping[str, str]) -> Callable[[], Any] | None:
        """Every rank but 0, once ``target`` is written everywhere: the job (run on a
        background thread) that hands this node's part of it to the tier, on the node's leader
        of a node-local directory; else ``None``."""

    def publish(self, target: Path, first: bool) -> dict[str, Any]:
        """Make the sealed step ``target`` this tier's; the figures to record. ``first``: its
        commit's publication (else it gained files since, e.g. its Hugging Face export).
        Raises when it is not published."""

    def unpublished(self) -> list[Path]:
        """The sealed local steps a killed run left unpublished here, to publish now."""

    # --- the steps it holds ----------------------------------------------------------------

    def complete_steps(self) -> list[StepDir]:
        """Its complete (published) steps, oldest first."""

    def managed_steps(self) -> list[StepDir]:
        """Its complete steps that this package's runs wrote: those retention may delete."""

    def has_last(self) -> bool:
        """Whether ``fit(ckpt_path="last")`` finds a step to resume here (every rank)."""

    # --- retention (rank 0, the commit thread) ---------------------------------------------

    def tidy(self, newest: int) -> None:
        """After a commit: remove what failed or killed saves older than ``newest`` left."""

    def remove(self, step: StepDir) -> None:
        """Delete ``step`` from this tier (its marker first: never a damaged step)."""

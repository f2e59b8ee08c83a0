"""``fit(ckpt_path="last")`` with a fast tier: the newest complete step of either tier, found by
every rank together, with the copies a rank lacks fetched from the node that holds them.

Collective (every rank, at the load), in this order:

1. each rank lists its node's fast steps (:func:`files.inventory`); every rank gets every list;
2. the candidates: fast steps newer than the persistent tier's last one, marked complete on
   some node, newest first. For each, every rank's files must be on some node: the rank's own
   node first, else the nodes of its peers;
3. the copies that would be used are read once, in full, hashed as they are read and compared
   with their seals (each by a rank of the node that holds it), and with ``check_finite`` loaded
   from those bytes and checked for NaNs and infinities; a torn, missing, altered or non-finite
   copy is passed over for the next holder, and a rank with none left rules the step out, with
   a warning naming why;
4. a rank whose own node lacks its good copy receives it from the holder (the bytes the holder
   checked: not read again), checks each file against the seal as it arrives, and writes it
   into its node's directory in a thread of its own, the seal last (a replaced node is
   repopulated as it resumes). A copy that does not match its seal rules the step out on every
   rank, as in 3. With ``keep``, the state is loaded from the received bytes and the write
   starts once that load is done (:meth:`Recovery.start_writes`; the callback: as training
   starts), so that it does not compete with the load: the caller joins it with
   :meth:`Recovery.settle` before the fast tier relies on the node's copy (collective; the
   callback: at the first fast save); without, it is written and joined here, and a failed
   write rules the step out;
5. every node drops the fast steps newer than the one chosen (the future that was not kept).

The outcome: the fast step to load, or the persistent tier (``None`` there when it has no
step either: the run starts from scratch). With ``keep``, it also holds the bytes of this
rank's own files as they matched the seal (:attr:`Recovery.held`): the copy read from its node
or received from a peer, so that the load uses them without reading the files again.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_mcore_ckpt.engine import non_finite
from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.fast.peers import (
    Bundle,
    Data,
    Incoming,
    Landing,
    NodeMap,
    Outgoing,
    handshake,
    header,
)

__all__ = ["Recovery", "recover"]

log = logging.getLogger(__name__)


@dataclass
class Recovery:
    """What a resume was served from (the same on every rank)."""

    step: int | None
    """The fast step resumed, or ``None``: the persistent tier's last step (if any)."""
    directory: Path | None
    """Its directory on this node."""
    sources: dict[int, int] = field(default_factory=dict)
    """Per rank, the rank whose node's copy it loads (itself: its own node's)."""
    skipped: list[str] = field(default_factory=list)
    """Why each newer fast step was not used."""
    time_s: float = 0.0
    """How long finding and fetching took."""
    held: Bundle | None = field(default=None, repr=False)
    """This rank's own files of :attr:`step`, as they matched their seal, in memory (only with
    ``recover(keep=True)``): the load uses these bytes, not the files."""
    writing: list[tuple[int, Landing]] = field(default_factory=list, repr=False)
    """This rank's copies fetched from a peer (by source), still being written into its node's
    directory (only with ``recover(keep=True)``): joined by :meth:`settle`."""
    timeout_s: float = 600.0
    """The bound on :meth:`settle`'s wait for the write."""

    def start_writes(self) -> None:
        """Start writing the copies fetched from peers into this node's directory (with
        ``recover(keep=True)``, once the state is loaded from their bytes; :meth:`settle`
        starts any not started)."""
        for _, landing in self.writing:
            landing.start()

    def settle(self, group: Any, *, together: bool = True) -> str | None:
        """Wait for the copies fetched from peers to be written into their nodes' directories
        (sealed last); what failed, on every rank (``None``: each is whole and sealed on its
        node). Collective over ``group`` when ``together`` and a rank's copy came from a peer
        (the same on every rank); else this rank's own, logged. Once settled, the step is as
        durable on each node as its copies' seals say; nothing of the fast tier may rely on a
        fetched copy before (a save, a retention, another recovery)."""
        landings, self.writing = self.writing, []
        error = None
        for source, landing in landings:
            try:
                landing.join(self.timeout_s)
            except OSError as err:  # TimeoutError too
                error = (
                    f"rank {landing.rank} ({socket.gethostname()}) writing its files of fast "
                    f"step {self.step} fetched from rank {source} into its node's directory: {err}"
                )
                log.warning("fast tier: %s; that node holds no copy of them", error)
        if not together or not self.from_peers:
            return error
        errors = [e for e in _gather(error, group) if e is not None]
        return "; ".join(errors) if errors else None

    @property
    def from_peers(self) -> int:
        """The ranks whose files came from another node."""
        return sum(1 for rank, source in self.sources.items() if rank != source)

    def record(self) -> dict[str, Any]:
        return {
            "tier": "persistent" if self.step is None else "fast",
            "step": self.step,
            "ranks_from_peers": self.from_peers,
            "ranks": len(self.sources),
            "skipped": list(self.skipped),
            "time_s": self.time_s,
        }


def _world(group: Any) -> int:
    distributed = dist.is_available() and dist.is_initialized()
    return dist.get_world_size(group) if distributed else 1


def _gather(value: Any, group: Any) -> list[Any]:
    if _world(group) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def recover(
    root: Path,
    nodes: NodeMap,
    rank: int,
    replicas: int,
    newer_than: int | None,
    group: Any,
    layout: dict[str, int] | None = None,
    *,
    check_finite: bool = False,
    keep: bool = False,
    timeout_s: float = 600.0,
) -> Recovery:
    """Find, check and fetch the fast step to resume (see the module). ``newer_than``: the
    persistent tier's last step (``None``: it has none); ``layout``: this run's parallel sizes
    (a step saved in others is not resumed); ``check_finite``: a copy holding a NaN or an
    infinity is passed over; ``keep``: this rank's own files, as checked, are kept in
    :attr:`Recovery.held` for the load (else they are read again from the node's directory),
    and the copies fetched from peers are still being written when this returns: the caller
    loads from :attr:`Recovery.held`, then calls :meth:`Recovery.settle` (``timeout_s``: its
    bound on that wait). Collective over ``group``."""
    started = time.perf_counter()
    world = _world(group)
    inventories = _gather(_inventory(root, world, layout), group)
    outcome = Recovery(None, None)
    candidates = _candidates(inventories, newer_than)
    if newer_than is not None and not any(inventories):
        # A persistent step, and no fast step anywhere: every node's directory was lost.
        outcome.skipped.append("no node holds any fast step (their directories are empty)")
    for step in candidates:
        holders = _holders(inventories, nodes, step, world, replicas)
        held: dict[int, Bundle] = {}  # the copies this rank read and checked, by owner
        arriving: list[Incoming] = []  # this rank's copy on its way from a peer
        checked = (
            _foreign(inventories, step)
            or _unheld(holders)
            or _checked_sources(
                root, step, holders, rank, group, check_finite, keep, held, arriving
            )
        )
        writing: list[tuple[int, Landing]] = []
        problem = (
            checked
            if isinstance(checked, str)
            else _fetch(root, step, checked, rank, group, held, writing, arriving, keep)
        )
        found = Recovery(step, None, {}, outcome.skipped, writing=writing, timeout_s=timeout_s)
        if problem is None and not keep and not isinstance(checked, str):
            # The load reads the files from the directory: written first, or the step is out.
            found.sources = checked
            problem = found.settle(group)
        if problem is not None or isinstance(checked, str):
            found.settle(group, together=False)  # this step's copies written as far as they go
            outcome.skipped.append(f"fast step {step}: {problem}")
            continue
        mine = held.get(rank) if keep else None
        outcome = Recovery(
            step,
            files.step_dir(root, step),
            checked,
            outcome.skipped,
            held=mine,
            writing=found.writing,
            timeout_s=timeout_s,
        )
        break
    _drop_newer(root, nodes, rank, outcome.step, newer_than, inventories)
    outcome.time_s = time.perf_counter() - started
    return outcome


def _inventory(root: Path, world: int, layout: dict[str, int] | None) -> dict[int, Any]:
    """This node's fast steps; none when its directory cannot be read (said, not raised: the
    other ranks are waiting for this one's list)."""
    try:
        return files.inventory(root, world, layout)
    except OSError as err:
        log.warning("fast tier: %s cannot be read (%s); this node's copies are not used", root, err)
        return {}


def _candidates(inventories: list[dict[int, Any]], newer_than: int | None) -> list[int]:
    marked = {s for inv in inventories for s, what in inv.items() if what["complete"]}
    return sorted((s for s in marked if newer_than is None or s > newer_than), reverse=True)


def _holders(
    inventories: list[dict[int, Any]], nodes: NodeMap, step: int, world: int, replicas: int
) -> dict[int, list[int]]:
    """Per rank, the ranks whose node holds its files of ``step``, one per node: the rank
    itself on its own node, then its peers (the ranks it copied to), then any other node's
    first rank that lists them. Each copy is thus hashed and sent by the rank that received
    it, and a node's copies are spread over its ranks."""
    listed: dict[int, dict[int, list[int]]] = {r: {} for r in range(world)}
    for holder, inventory in enumerate(inventories):
        for owner in inventory.get(step, {}).get("held", []):
            listed[owner].setdefault(nodes.node_of(holder), []).append(holder)
    out: dict[int, list[int]] = {}
    for owner in range(world):
        preferred = [owner, *nodes.peers(owner, replicas)]
        chosen: dict[int, int] = {}
        for node, ranks in listed[owner].items():
            mine = [r for r in preferred if r in ranks]
            # On the owner's node, the owner reads its own files: nothing moves.
            chosen[node] = owner if node == nodes.node_of(owner) else (mine or ranks)[0]
        order = [nodes.node_of(r) for r in preferred]
        order += sorted(n for n in chosen if n not in order)
        out[owner] = [chosen[n] for n in order if n in chosen]
    return out


def _foreign(inventories: list[dict[int, Any]], step: int) -> str | None:
    if not any(inv.get(step, {}).get("foreign") for inv in inventories):
        return None
    return (
        "saved in another world size or parallel layout; a fast step resumes only the layout "
        "that saved it (the persistent tier reshards)"
    )


def _unheld(holders: dict[int, list[int]]) -> str | None:
    missing = [owner for owner, held in holders.items() if not held]
    if not missing:
        return None
    return f"no node holds the files of rank(s) {missing} (their nodes' directories are gone)"


def _checked_sources(
    root: Path,
    step: int,
    holders: dict[int, list[int]],
    rank: int,
    group: Any,
    check_finite: bool,
    keep: bool,
    held: dict[int, Bundle],
    arriving: list[Incoming],
) -> dict[int, int] | str:
    """Per rank, the first holder whose copy hashes to its seal (and, with ``check_finite``,
    holds no NaN or infinity); or why there is none. Each copy this rank checks is read once;
    ``held`` gets, by owner, the bytes of those it will (``keep``) load itself. A copy that
    goes to another node is sent as its holder reads it, while it is checked (:func:`_streams`);
    ``arriving`` gets this rank's own copy on its way, once its holder's check found it whole.
    """
    directory = files.step_dir(root, step)
    tried = {owner: 0 for owner in holders}
    problems: dict[int, list[str]] = {owner: [] for owner in holders}
    while True:
        asked = {o: h[tried[o]] for o, h in holders.items() if tried[o] < len(h)}
        if len(asked) < len(holders):
            failed = sorted(o for o in holders if o not in asked)
            why = "; ".join(p for o in failed for p in problems[o])
            return f"no whole copy of rank(s) {failed}'s files: {why}"
        outgoing, incoming = _streams(directory, asked, rank, group)
        mine = _check_all(
            directory,
            [o for o, h in asked.items() if h == rank],
            rank,
            check_finite,
            keep,
            held,
            outgoing,
        )
        for going in outgoing.values():
            going.wait()  # taken by its owner
        if incoming is not None:
            incoming.take()  # hashed piece by piece as the holder reads and sends it
        verdicts: dict[int, str | None] = {}
        for found in _gather(mine, group):
            verdicts.update(found)
        bad = {o: v for o, v in verdicts.items() if v is not None}
        if not bad:
            arriving.extend([incoming] if incoming is not None else [])
            return asked
        if incoming is not None:
            incoming.drain()
        for owner, why in bad.items():
            problems[owner].append(f"the copy on rank {asked[owner]}'s node: {why}")
            tried[owner] += 1


def _streams(
    directory: Path, asked: dict[int, int], rank: int, group: Any
) -> tuple[dict[int, Outgoing], Incoming | None]:
    """Start moving the copies that go to another node this round (point to point between
    each holder and owner): this rank's outgoing ones, by owner, their headers sent from
    their seals (a seal this rank cannot use announces nothing: the copy's check says why),
    to be sent as they are read (:func:`_check_all`); and its own copy's receives, posted,
    where a peer holds it."""
    sending = [o for o, h in asked.items() if h == rank and o != rank]
    source = asked.get(rank, rank)
    receiving = [source] if source != rank else []
    if not sending and not receiving:
        return {}, None
    seals = {o: _seal_and_sizes(directory, o) for o in sending}
    announcements = []
    for owner, found in seals.items():
        seal, sizes = found if found is not None else (None, [])
        announcements.append((owner, header(seal, sizes)))
    headers = handshake(group, announcements, receiving)
    outgoing = {o: Outgoing(group, o, *found) for o, found in seals.items() if found}
    announced = headers.get(source)
    incoming = None
    if announced is not None and int(announced[0]) == 1:
        incoming = Incoming(group, source, announced)
    return outgoing, incoming


def _seal_and_sizes(directory: Path, owner: int) -> tuple[bytes, list[int]] | None:
    """Rank ``owner``'s seal in ``directory`` and the sizes of the files it names, in order, as
    they are on this node's disk and in the seal; or ``None`` where the seal is missing, torn or
    another rank's, names a file the rank may not have, one missing or of another size, or
    more files than a copy carries (the check of the copy says what is wrong)."""
    try:
        seal = (directory / files.seal_name(owner)).read_bytes()
        record = files.parse_seal(seal)
        if record is None or record.get("rank") != owner:
            return None
        paths = files.sealed_paths(directory, record, owner)
        sizes = [paths[name].stat().st_size for name in record["files"]]
        if sizes != [entry["size"] for entry in record["files"].values()]:
            return None
        header(seal, sizes)
    except (OSError, ValueError, KeyError, TypeError):  # UnsafeNameError too
        return None
    return seal, sizes


def _check_all(
    directory: Path,
    owners: list[int],
    rank: int,
    check_finite: bool,
    keep: bool,
    held: dict[int, Bundle],
    outgoing: dict[int, Outgoing],
) -> dict[int, str | None]:
    """What is wrong with each of ``owners``' copies in ``directory`` (``None``: whole,
    unchanged and, with ``check_finite``, finite): the copies this rank holds for them, each
    read once. A good copy's bytes go to ``held`` when this rank loads it (its own, with
    ``keep``). Another rank's copy in ``outgoing`` is sent piece by piece as it is read, through
    a few pieces of memory reused (:meth:`Outgoing.window`), or from the whole copy read to
    check its values (``check_finite``).

    Several copies are read at once, a thread each: a node that serves a replaced node's copies
    reads them and its own, and one stream of reads leaves the disk idle between its requests,
    which a second stream fills (the same bytes read; each copy hashed against its own seal,
    in the thread that reads it). The content check and what is kept are done here, after."""
    # Another rank's copy is read whole only to check its values; one sent on otherwise goes
    # piece by piece through memory reused (peers.RING).
    keeps = {o: check_finite or (keep and o == rank) for o in owners}
    if len(owners) < 2:
        found = {o: _read(directory, o, keeps[o], outgoing.get(o)) for o in owners}
    else:
        with ThreadPoolExecutor(len(owners), thread_name_prefix="lmc-fast-check") as pool:
            reading = {
                o: pool.submit(_read, directory, o, keeps[o], outgoing.get(o)) for o in owners
            }
            found = {o: f.result() for o, f in reading.items()}
    return {
        o: _judge(directory, o, found[o], check_finite, keep and o == rank, held) for o in owners
    }


def _read(
    directory: Path, owner: int, keep: bool, going: Outgoing | None = None
) -> tuple[bytes, list[Data]] | str | None:
    """Rank ``owner``'s copy in ``directory`` read and hashed against its seal: its seal and
    files' bytes (``keep``), or what is wrong, or ``None`` (whole and unchanged, not kept).
    ``going``: the copy is sent on as it is read, against the seal its header announced."""
    if going is not None:
        try:
            if not keep:  # read piece by piece into memory reused, sent as each is read
                return files.stream_checked(directory, owner, bytes(going.seal), going)
            found = files.read_checked(directory, owner, bytes(going.seal), going.ready)
        finally:
            going.close()  # whatever the read did not reach: the receiver's pieces complete
    elif not keep:
        return files.verify(directory, owner)  # nothing to keep: hashed as it streams by
    else:
        found = files.read_checked(directory, owner)
    return found if isinstance(found, str) else (found[0], list[Data](found[1]))


def _judge(
    directory: Path,
    owner: int,
    found: tuple[bytes, list[Data]] | str | None,
    check_finite: bool,
    keep: bool,
    held: dict[int, Bundle],
) -> str | None:
    """What is wrong with rank ``owner``'s copy, :func:`_read` having ``found`` it so; a good
    copy's bytes go to ``held`` when ``keep``."""
    if found is None or isinstance(found, str):
        return found
    bundle = Bundle(*found)
    problem = _non_finite(directory, owner, bundle) if check_finite else None
    if problem is None and keep:
        held[owner] = bundle
    return problem


def _non_finite(directory: Path, owner: int, bundle: Bundle) -> str | None:
    """What is not finite in rank ``owner``'s state, loaded from ``bundle`` (the bytes just
    checked against the seal; ``None``: all of it is finite)."""
    name = files.files_of(owner)[0]
    path = directory / name
    try:
        bad = non_finite(_payload(bundle.named()[name], path))
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        return f"{path} cannot be loaded to check its values: {err}"
    return f"{path} holds non-finite values in {', '.join(bad)}" if bad else None


def _payload(data: Any, path: Path) -> Any:
    """A state file's payload from its bytes in memory, checked before it is unpickled as a
    load of the file is (torch's ``weights_only`` allowlist and the same extra types); its
    tensors are views of ``data`` (only read here: nothing is copied)."""
    from lightning_mcore_ckpt.safety import safe_load

    return safe_load.load_torch_file(path, data=data, share=True)


def _fetch(
    root: Path,
    step: int,
    sources: dict[int, int],
    rank: int,
    group: Any,
    held: dict[int, Bundle],
    writing: list[tuple[int, Landing]],
    arriving: list[Incoming],
    keep: bool,
) -> str | None:
    """Take each rank's copy where it comes from another node (collective): its holder sent
    it while checking it (:func:`_checked_sources`, ``arriving``); the owner checks each file
    against the seal as it arrives and queues it to be written into its node's directory
    (:class:`Landing`), and keeps the bytes in ``held``. The problem with a copy, the same on
    every rank, or ``None``. The writes go on: ``writing`` gets them (by source), to be joined
    (:meth:`Recovery.settle`) when no copy was refused, else after their last queued file;
    with ``keep`` they start only when told (:meth:`Recovery.start_writes`) or joined."""
    directory = files.step_dir(root, step)
    source = sources.get(rank, rank)
    error = None
    landings: list[Landing] = []
    incoming = arriving.pop() if arriving else None

    def arrived(index: int, count: int, data: Data) -> None:
        if index == 0:
            landings.append(Landing(directory, rank, count, deferred=keep))
        assert incoming is not None
        landings[-1].arrived(index, data, incoming.digest(index))

    if source != rank:
        try:
            if incoming is None:
                raise ValueError(f"rank {source} could not read it")
            try:
                incoming.arrive(arrived)
            except BaseException:
                for landing in landings:
                    landing.abandon()
                raise
            writing.append((source, landings[-1]))
            # Checked on arrival: the state is loaded from these bytes only if they matched.
            held[rank] = landings[-1].finish()
        except ValueError as err:
            error = (
                f"rank {rank} ({socket.gethostname()}) fetching its files from rank {source}: {err}"
            )
    errors = [e for e in _gather(error, group) if e is not None]
    return "; ".join(errors) if errors else None


def _drop_newer(
    root: Path,
    nodes: NodeMap,
    rank: int,
    chosen: int | None,
    newer_than: int | None,
    inventories: list[dict[int, Any]],
) -> None:
    """Delete, on each node, the fast steps newer than the step resumed: a run that resumes an
    older step never counts them again."""
    resumed = chosen if chosen is not None else newer_than
    if not nodes.leader(rank):
        return
    for step in inventories[rank]:
        if resumed is None or step > resumed:
            files.remove_step(files.step_dir(root, step))

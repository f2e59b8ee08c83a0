"""A simulated node's own view of the machine: a mount namespace in which one directory is the
node's own disk, and a UTS namespace with the node's host name (Linux, as root).

:func:`enter_node` is what each node launcher of :func:`~lightning_mcore_ckpt.launch.nodes.run_nodes`
does before it starts its ranks; :func:`unavailable` says, once per process, whether this machine
lets it (why not, or ``None``). No torch here: it is light to import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import socket
from pathlib import Path

from lightning_mcore_ckpt.launch._child import ask_a_child

__all__ = ["enter_node", "node_storage", "unavailable"]

# <sched.h> and <sys/mount.h>; os has the first two on Python 3.12 only.
_CLONE_NEWNS = getattr(os, "CLONE_NEWNS", 0x00020000)
_CLONE_NEWUTS = getattr(os, "CLONE_NEWUTS", 0x04000000)
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18

_FIX = (
    "simulated nodes with a node_dir need Linux, root (CAP_SYS_ADMIN) and mount and UTS "
    "namespaces (as `unshare --mount --uts` does): run the tests as root, e.g. in a container "
    "started with --privileged or --cap-add SYS_ADMIN"
)


def node_storage(node_dir: str | os.PathLike[str], node: int) -> Path:
    """The directory that is ``node_dir`` on node ``node`` (``<node_dir>.nodes/node<i>``), as
    the parent of the nodes sees it.

    Example::

        run_nodes(write_a_file, 2, 1, node_dir=tmp / "local")
        assert (node_storage(tmp / "local", 1) / "written-on-node1").exists()
    """
    path = Path(node_dir).absolute()
    return path.with_name(f"{path.name}.nodes") / f"node{node}"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12
        os.unshare(flags)
        return
    if _libc().unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = None if source is None else os.fsencode(source)
    if _libc().mount(src, os.fsencode(target), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _isolate(hostname: str) -> None:
    """This process (and what it starts from now on) in namespaces of its own: mounts made here
    are seen nowhere else, and the host name is ``hostname``."""
    _unshare(_CLONE_NEWNS | _CLONE_NEWUTS)
    _mount(None, "/", _MS_REC | _MS_PRIVATE)  # nothing propagates back to the machine
    socket.sethostname(hostname)


def enter_node(node_dir: str | os.PathLike[str], node: int, hostname: str) -> Path:
    """Become node ``node``: its storage (:func:`node_storage`) mounted on ``node_dir``, host
    name ``hostname``. Returns the node's temporary directory, ``<node_dir>/tmp`` (created)."""
    _isolate(hostname)
    _mount(str(node_storage(node_dir, node)), str(Path(node_dir).absolute()), _MS_BIND)
    tmp = Path(node_dir).absolute() / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot give simulated nodes their own directory and host name (what to
    do about it), or ``None`` when it can. Asked once per process, in a child process."""
    if not hasattr(os, "fork") or not Path("/proc/self/ns/mnt").exists():
        return f"no mount namespaces on this platform: {_FIX}"
    answered, why = ask_a_child(_probe)
    return None if answered else f"{why or 'the probe died'}: {_FIX}"


def _probe() -> str:
    _isolate("probe")
    return ""

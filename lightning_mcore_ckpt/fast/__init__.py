"""The fast tier: each rank's whole state on its node's own disk, copied to peer nodes.

A second tier next to the persistent one (a shared file system or an object store): saved
often, to node-local storage, and read back in seconds by the same ranks, in the same layout,
from their own node, or from the peer node that holds a copy when theirs was lost.

Modules, in their order of imports:

  config      FastTier: the options
  recovery    the newest complete step, found by every rank together; copies fetched
  writer      FastWriter: stage, write and seal in the background, copy to peers, count
  peers       which nodes hold whose copies; copies sent between them
  files       what a node's directory holds; a copy whole and unchanged
  media       a copy in memory (/dev/shm) mapped where it is, one on a disk read
"""

from lightning_mcore_ckpt.fast.config import FastTier

__all__ = ["FastTier"]

"""Start a function on N local processes that form a process group, as a launcher would
(``local``), forked from a server process that imported the heavy libraries once without
initialising CUDA (``forkserver``). The resume check runs its jobs this way; tests too
(``lightning_mcore_ckpt.testing.run_distributed``). Simulated nodes (``nodes``): a launcher
per node that forks its ranks, each node with its own directory at one path and its own host
name (``namespaces``, through ``_child``), for tests of several nodes
(``lightning_mcore_ckpt.testing.run_nodes``).
"""

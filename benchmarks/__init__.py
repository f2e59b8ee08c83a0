"""Save/load benchmarks of lightning-mcore-ckpt against the disk and the alternatives."""

"""A run's state beyond its weights, and the process groups it runs on: per-rank RNG
(``rng``), ordinary torch optimizers' sharded state (``optim``), the resumable sampler
(``sampler``), LoRA adapters (``adapters``) and Megatron-Core's parallel state (``parallel``).
"""

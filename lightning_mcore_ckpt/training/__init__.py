"""A run's state beyond its weights, and the process groups it runs on: per-rank RNG
(``rng``), ordinary torch optimizers' sharded state (``optim``), the resumable sampler
(``sampler``), LR and weight-decay schedules (``schedules``), LoRA adapters (``adapters``),
Megatron-Core's parallel state (``parallel``) and
the ``TransformerConfig`` fields a user sets on a model (``model_config``).
"""

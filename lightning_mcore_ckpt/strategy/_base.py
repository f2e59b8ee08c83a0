"""The Lightning plumbing of ``MegatronStrategy``: options, topology, process groups.

Undocumented overrides only; what users call is on ``MegatronStrategy`` itself.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_mcore_ckpt import _cpu
from lightning_mcore_ckpt.strategy import _grads
from lightning_mcore_ckpt.strategy._config import StrategyConfig
from lightning_mcore_ckpt.training import parallel as _parallel

__all__ = ["MegatronParallelBase"]


class MegatronParallelBase(ParallelStrategy):
    """Megatron-Core parallel state under Lightning, from a :class:`StrategyConfig`.

    Sets up the process group and Megatron's parallel state, answers Lightning's questions
    about the topology, and runs the collectives Lightning asks for. Full state dicts are never
    built: weights and optimizer state go to sharded checkpoints instead.
    """

    def __init__(self, config: StrategyConfig) -> None:
        super().__init__()
        self.config = config
        """The strategy's options, as given (checked)."""
        self._process_group_backend = config.process_group_backend
        self._timeout = config.timeout
        self.num_nodes = 1

    # --- options (read-only views of the config) ------------------------------------------

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.config.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.config.pipeline_model_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self.config.context_parallel_size

    @property
    def expert_model_parallel_size(self) -> int:
        return self.config.expert_model_parallel_size

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def ckpt_async_save(self) -> bool:
        return self.config.ckpt_async_save

    @property
    def ckpt_parallel_save(self) -> bool:
        return self.config.ckpt_parallel_save

    @property
    def ckpt_parallel_load(self) -> bool:
        return self.config.ckpt_parallel_load

    @property
    def init_from(self) -> Path | None:
        """``init_from`` as a path (``~`` expanded), or ``None``."""
        return self.config.init_path

    @property
    def process_group_backend(self) -> str | None:
        """The backend given, else (once set up) the one chosen: nccl with CUDA, gloo without."""
        return self._process_group_backend

    # --- topology -------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        from megatron.core import parallel_state

        return {
            "num_replicas": parallel_state.get_data_parallel_world_size(),
            "rank": parallel_state.get_data_parallel_rank(),
        }

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide whether to inject a DistributedSampler
        # (keyed by distributed_sampler_kwargs: the data-parallel rank, not the global rank).
        # With one data-parallel rank and one pipeline stage there is nothing to split, and the
        # loader's own sampler (e.g. torchdata's stateful RandomSampler, which saves its
        # generator) is kept as is. Pipeline stages are seeded differently (as in Megatron-LM),
        # so with PP > 1 a seeded DistributedSampler keeps every stage on the same batch.
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return bool(
                parallel_state.get_data_parallel_world_size() > 1
                or parallel_state.get_pipeline_model_parallel_world_size() > 1
            )
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Optimizer state is loaded, sharded, in load_checkpoint.
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        # The backend follows the devices the ranks train on, not what the machine has:
        # accelerator="cpu" on a GPU machine is a gloo group.
        backend = _parallel.backend_for(self.root_device.type, self._process_group_backend)
        self._process_group_backend = backend
        _cpu.install(self.root_device.type)  # CPU ranks: also on a machine with GPUs
        if not _distributed_is_initialized():
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        _parallel.initialize(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            seed=self.seed,
            timeout=self._timeout,
            device_type=self.root_device.type,
        )

    def _convert_precision(self) -> None:
        """Let the precision plugin convert the module, as Lightning's ``Strategy.setup`` does.

        ``"bf16-true"`` / ``"16-true"`` convert every parameter: Megatron-Core modules are then
        told so (``config.pipeline_dtype``: pipeline stages exchange activations of that
        dtype). Refused for a model in Megatron DDP, whose fp32 gradient buffers and main
        parameters cannot follow: Megatron-Core's own mixed precision does that instead.
        """
        from lightning.pytorch.plugins.precision import HalfPrecision
        from megatron.core.distributed import DistributedDataParallel

        assert self.model is not None
        plugin = self.precision_plugin
        if isinstance(plugin, HalfPrecision):
            if any(isinstance(m, DistributedDataParallel) for m in self.model.modules()):
                raise ValueError(
                    f"Trainer(precision={plugin.precision!r}) converts every parameter, which "
                    "Megatron DDP's gradient buffers and a Megatron optimizer's fp32 main "
                    "parameters cannot follow. Use Megatron-Core's mixed precision instead: the "
                    "model built with TransformerConfig(bf16=True, params_dtype=torch.bfloat16) "
                    "in Float16Module, and OptimizerConfig(bf16=True), with precision='32-true' "
                    "(docs/gpu.md)"
                )
            for module in _grads.megatron_modules(self.model):
                config = getattr(module, "config", None)
                if config is not None and getattr(config, "pipeline_dtype", None) is not None:
                    config.pipeline_dtype = plugin._desired_input_dtype
        self.model = plugin.convert_module(self.model)

    def _check_model_configs(self) -> None:
        assert self.model is not None
        for module in _grads.megatron_modules(self.model):
            config = getattr(module, "config", None)
            if config is None:
                continue
            for attr, expected in (
                ("tensor_model_parallel_size", self.tensor_model_parallel_size),
                ("pipeline_model_parallel_size", self.pipeline_model_parallel_size),
                ("sequence_parallel", self.sequence_parallel),
            ):
                got = getattr(config, attr, expected)
                if got != expected:
                    raise ValueError(
                        f"{type(module).__name__}.config.{attr}={got!r} but "
                        f"MegatronStrategy({attr}={expected!r}); build the model's "
                        "TransformerConfig from the strategy's settings"
                    )
            break

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- collectives ----------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> torch.Tensor | Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # --- full state dicts: none -----------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Weights are written sharded by save_checkpoint, never as a full state dict.
        return {}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # Loaded in load_checkpoint, sharded.
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        return None

    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        return nullcontext()

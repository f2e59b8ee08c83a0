"""The CPU adaptations: active in a process that trains on the CPU (on any machine), a strict
no-op in one that trains on CUDA, and confined to Megatron modules. None of these tests assumes
the machine has no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from lightning_mcore_ckpt import _cpu


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_install_for_cpu_devices_is_idempotent_and_reports_active() -> None:
    assert _cpu.install("cpu") is True
    assert _cpu.install("cpu") is True
    assert _cpu.installed() and _cpu.on_cpu()
    assert not _cpu.parallel_load_supported()
    assert _cpu.transformer_config_overrides()["use_cpu_initialization"] is True


def test_global_torch_cuda_is_untouched() -> None:
    _cpu.install("cpu")
    from megatron.core.tensor_parallel import mappings

    assert mappings.torch is not torch
    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    # Outside the listed Megatron modules, torch.cuda is the real one.
    assert torch.cuda.current_device is not mappings.torch.cuda.current_device
    assert mappings.torch.nn is torch.nn


def test_megatron_cuda_rng_is_the_cpu_generator() -> None:
    _cpu.install("cpu")
    from megatron.core.tensor_parallel import random as mcore_random

    torch.manual_seed(7)
    state = mcore_random._get_cuda_rng_state()
    a = torch.rand(3)
    mcore_random._set_cuda_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_async_staging_copies_cpu_tensors() -> None:
    _cpu.install("cpu")
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    weight = torch.zeros(4)
    bucket = [("f", "k", ([], [("item", weight)]))]
    staged = FileSystemWriterAsync.preload_tensors(bucket, non_blocking=True)
    weight.add_(1.0)  # training goes on after staging
    assert torch.equal(staged[0][2][1][0][1], torch.zeros(4))


def test_install_does_nothing_when_cuda_is_available() -> None:
    result = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from lightning_mcore_ckpt import _cpu
        assert _cpu.install() is False  # the machine's devices: CUDA
        assert _cpu.install("cuda") is False
        assert not _cpu.installed() and not _cpu.on_cpu()
        assert _cpu.parallel_load_supported()
        assert _cpu.transformer_config_overrides() == {}
        assert _cpu.optimizer_metadata_overrides() == {}
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec()
        assert _cpu.local_spec_norms(spec, None) is spec
        assert torch.zeros(1).type() == "torch.FloatTensor"
        from megatron.core.tensor_parallel import mappings, random
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core import utils
        assert mappings.torch is torch
        assert random._get_cuda_rng_state.__module__ == random.__name__
        assert not hasattr(filesystem_async.FileSystemWriterAsync.preload_tensors, "__wrapped__")
        assert not hasattr(utils.GlobalMemoryBuffer.get_tensor, "__wrapped__")
        from megatron.core import jit
        from megatron.core.transformer.moe.router import TopKRouter
        from lightning_mcore_ckpt._cpu import _eager
        assert jit.jit_fuser is torch.compile
        assert "megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias" in (
            _eager.compiled_helpers()
        )
        print("untouched")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "untouched" in result.stdout


def test_a_process_training_on_the_cpu_of_a_machine_with_cuda_is_adapted() -> None:
    # Trainer(accelerator="cpu") on a GPU machine: Megatron-Core must not reach for the GPU.
    result = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from lightning_mcore_ckpt import _cpu
        assert _cpu.on_cpu() is False  # nothing asked yet: the machine's devices
        assert _cpu.install("cpu") is True
        assert _cpu.installed() and _cpu.on_cpu()
        assert not _cpu.parallel_load_supported()
        assert _cpu.optimizer_metadata_overrides()
        from megatron.core.tensor_parallel import mappings
        assert mappings.torch.cuda.current_device() == torch.device("cpu")
        print("adapted")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "adapted" in result.stdout


def test_megatron_helpers_run_eagerly_and_a_users_compile_is_untouched() -> None:
    _cpu.install("cpu")
    from megatron.core import jit
    from megatron.core.transformer.moe.router import TopKRouter

    from lightning_mcore_ckpt._cpu import _eager

    assert _eager.compiled_helpers() == []
    assert not hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")
    # Modules imported from now on decorate with a no-op.
    assert jit.jit_fuser(len) is len

    def users(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    compiled = torch.compile(users)
    assert compiled._torchdynamo_orig_callable is users  # type: ignore[attr-defined]


def test_an_moe_with_expert_bias_trains_on_a_cpu_without_a_cxx_compiler() -> None:
    # The router's expert-bias update is torch.compile'd by Megatron-Core: on the CPU, inductor
    # builds C++ at the first forward, which fails where no compiler works.
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MOE_STEP)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "CXX": "/nonexistent/g++", "RANK": "0", "WORLD_SIZE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained" in result.stdout


_MOE_STEP = """
    import os
    from lightning_mcore_ckpt.launch.local import find_free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    import torch
    import torch.distributed as dist
    from lightning_mcore_ckpt import _cpu
    _cpu.install("cpu")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    from lightning_mcore_ckpt.tiny import tiny_gpt
    model = tiny_gpt(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, add_bias_linear=False,
        moe_token_dispatcher_type="alltoall", moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid", moe_router_load_balancing_type="none",
    )
    tokens = torch.randint(0, 100, (2, 16))
    position_ids = torch.arange(16).expand(2, 16)
    model(tokens, position_ids, None, labels=tokens).sum().backward()
    (router,) = {type(m).__name__: m for m in model.modules() if hasattr(m, "expert_bias")}.values()
    assert router.local_tokens_per_expert.sum() > 0  # the expert-bias update ran
    dist.destroy_process_group()
    print("trained")
"""


def test_cuda_type_strings_are_reported_only_inside_the_optimizers_checks() -> None:
    _cpu.install("cpu")
    from megatron.core.optimizer import clip_grads

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 2.0)
    assert weight.type() == "torch.FloatTensor"
    # Asserts param.grad.type() == "torch.cuda.FloatTensor" before it scales.
    clip_grads.clip_grad_by_total_norm_fp32([weight], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(weight.grad, torch.full((3,), 0.5), atol=1e-5)
    assert weight.type() == "torch.FloatTensor"
    assert weight.type(torch.float64).dtype == torch.float64


def test_local_spec_norms_allow_sequence_parallelism_and_mark_their_parameters() -> None:
    # Megatron-Core's torch norm refuses sequence parallelism; the CPU runtime's builds the
    # same torch module with its parameters marked for the sum over tensor-parallel ranks.
    _cpu.install("cpu")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec()
    config = TransformerConfig(
        num_layers=3,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        persist_layer_norm=False,
    )
    block = _cpu.local_spec_norms(layer, config)

    assert layer.submodules.input_layernorm is WrappedTorchNorm  # the given spec is unchanged
    assert isinstance(block, TransformerBlockSubmodules)
    assert len(block.layer_specs) == 3
    norms = [block.layer_norm, *(s.submodules.input_layernorm for s in block.layer_specs)]
    for build in norms:
        norm = build(config=config, hidden_size=8, eps=1e-5)
        assert type(norm) is torch.nn.LayerNorm
        assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [True, True]

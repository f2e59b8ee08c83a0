"""Megatron-Core's compiled helpers, run eagerly on the CPU.

Megatron-Core compiles a few small helpers with ``torch.compile``: those decorated with
``megatron.core.jit.jit_fuser`` (the MoE router's expert-bias update, the token dispatcher's
preprocessing, fused activations, a norm) and a few decorated with ``@torch.compile`` directly
(the router's top-k on 0.19). On the CPU, inductor generates C++ for each at a process's first
call and builds it with the system's C++ compiler. A process without a working compiler (a
laptop without build tools, a slim container) then fails at its first training step
(``InvalidCxxCompiler``); one with a compiler spends seconds of CPU in every process (about 3 s
with inductor's cache warm, 30 s cold, for an MoE router's expert bias) to fuse a few
element-wise operations. On the CPU these helpers run as the Python functions they wrap: the
same operations, unfused.

Only Megatron-Core's modules are changed (``megatron.*``): ``torch.compile`` itself, and what a
user compiles, are untouched.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["compiled_helpers", "run_compiled_helpers_eagerly"]

_PACKAGE = "megatron"


def _wrapped(value: Any) -> Any:
    """The function a ``torch.compile`` wrapper (or a static or class method of one) wraps;
    ``None`` for anything else (a function that ``torch.compiler.disable`` wraps is left as it
    is)."""
    if type(value) in (staticmethod, classmethod):
        value = value.__func__
    if type(value) is not types.FunctionType or getattr(value, "_torchdynamo_disable", False):
        return None
    return getattr(value, "_torchdynamo_orig_callable", None)


def _bound_wrappers() -> Iterator[tuple[Any, str, Any, Any]]:
    """Each ``torch.compile`` wrapper bound in Megatron-Core's imported modules and in the
    classes they define: ``(owner, name, value, wrapped function)``."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
            continue
        classes = [
            value
            for value in vars(module).values()
            if isinstance(value, type) and value.__module__ == module.__name__
        ]
        for owner in (module, *classes):
            for attribute, value in list(vars(owner).items()):
                original = _wrapped(value)
                if original is not None:
                    yield owner, attribute, value, original


def compiled_helpers() -> list[str]:
    """The ``torch.compile`` wrappers bound in Megatron-Core's imported modules and classes, as
    ``module.name`` or ``module.Class.name`` (empty once :func:`run_compiled_helpers_eagerly`
    ran)."""
    return [
        f"{owner.__name__}.{name}"
        if isinstance(owner, types.ModuleType)
        else f"{owner.__module__}.{owner.__name__}.{name}"
        for owner, name, _, _ in _bound_wrappers()
    ]


def run_compiled_helpers_eagerly() -> None:
    """Bind every ``torch.compile`` wrapper in Megatron-Core's imported modules and classes to
    the function it wraps (a static or class method stays one), and make ``jit_fuser`` a no-op
    decorator for the modules imported from now on."""
    from megatron.core import jit

    jit.disable_jit_fuser()
    for owner, name, value, original in list(_bound_wrappers()):
        if isinstance(value, (staticmethod, classmethod)):
            original = type(value)(original)
        setattr(owner, name, original)

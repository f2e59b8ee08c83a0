"""A config dataclass's fields as a constructor's keyword arguments, written once.

An object whose options are a dataclass (``MegatronStrategy`` and ``StrategyConfig``) spells
them out as keyword arguments, for type checkers; :func:`keyword_options` checks the names a
call gives (an unknown one is refused naming the closest field) and gives the constructor what
``inspect`` and LightningCLI read: a signature listing the fields (types and defaults) and an
``Args:`` section made of the docstring under each field (:func:`field_docs`). Imports nothing
of the package.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import textwrap
import typing
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["field_docs", "keyword_options"]

_Init = TypeVar("_Init", bound=Callable[..., None])


def field_docs(config: type[Any]) -> dict[str, str]:
    """The docstring under each field of the dataclass ``config``, on one line, by field name.

    Read from the source, as documentation tools read it; empty when the source is not shipped
    (a frozen application).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(config)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = typing.cast(ast.ClassDef, tree.body[0]).body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def keyword_options(config: type[Any]) -> Callable[[_Init], _Init]:
    """Decorate an ``__init__`` whose keyword arguments are the fields of ``config``.

    The wrapper refuses a keyword that is not a field, naming the closest one (a
    ``TypeError``, as Python's for an unknown argument); its ``__signature__`` lists the fields
    with their types and defaults, and its docstring gets an ``Args:`` section from their
    docstrings: LightningCLI's ``--help`` reads both.
    """
    fields = [f for f in dataclasses.fields(config) if f.init]
    names = [f.name for f in fields]

    def decorate(init: _Init) -> _Init:
        @functools.wraps(init)
        def checked(self: Any, **options: Any) -> None:
            for name in options:
                if name not in names:
                    close = difflib.get_close_matches(name, names, n=1)
                    hint = f"did you mean {close[0]}? " if close else ""
                    raise TypeError(
                        f"{type(self).__name__}({name}={options[name]!r}): no such option; "
                        f"{hint}the options are the fields of "
                        f"{config.__module__.rsplit('.', 1)[0]}.{config.__name__}"
                    )
            init(self, **options)

        hints = typing.get_type_hints(config)
        keyword = inspect.Parameter.KEYWORD_ONLY
        checked.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [
                inspect.Parameter(f.name, keyword, default=_default(f), annotation=hints[f.name])
                for f in fields
            ],
            return_annotation=None,
        )
        docs = field_docs(config)
        args = "".join(f"\n    {name}: {docs[name]}" for name in names if name in docs)
        if args:
            checked.__doc__ = f"{inspect.cleandoc(init.__doc__ or '')}\n\nArgs:{args}\n"
        return typing.cast(_Init, checked)

    return decorate


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default

"""Whether the object-storage tests may skip when boto3 or moto cannot be imported.

On a developer's machine without the ``s3`` extra they skip. Under CI they must run: there a
failed import fails them, with the import error and the fix, instead of a silent skip. CI is
recognised by ``CI`` (``true`` or ``1``: GitHub Actions, GitLab CI, CircleCI, Buildkite, ...
set it), by ``LMC_REQUIRE_S3=1``, and by ``LMC_REQUIRE_OTHER=1`` (which ``.ci/run`` sets for
the run of the whole suite).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

import pytest

MODULES = ("boto3", "moto")
"""What the object-storage tests import: the S3 client and the S3 server."""

FIX = "install the s3 and dev extras: pip install -e '.[s3,dev]' (boto3, moto)"


def required_by(environ: Mapping[str, str]) -> str | None:
    """Why these tests must run here (``"CI=true"``, ...), or ``None`` where they may skip."""
    if environ.get("LMC_REQUIRE_S3") == "1":
        return "LMC_REQUIRE_S3=1"
    if environ.get("CI", "").strip().lower() in ("true", "1"):
        return f"CI={environ['CI']}"
    if environ.get("LMC_REQUIRE_OTHER") == "1":
        return "LMC_REQUIRE_OTHER=1 (.ci/run)"
    return None


def import_errors(names: tuple[str, ...] = MODULES) -> dict[str, str]:
    """The modules of ``names`` that fail to import, with the error each raised."""
    errors = {}
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:  # another error is an error, as with pytest.importorskip
            errors[name] = f"{type(err).__name__}: {err}"
    return errors


def message(errors: Mapping[str, str], why: str) -> str:
    failed = "; ".join(f"{name} ({error})" for name, error in errors.items())
    return (
        f"the object-storage tests cannot run: {failed} failed to import, and {why} says they "
        f"must run here (they skip only outside CI); {FIX}"
    )


def import_or_skip(name: str, environ: Mapping[str, str] = os.environ) -> Any:
    """``pytest.importorskip(name)``, except that where :func:`required_by` says the tests
    must run, a failed import fails the test instead."""
    errors = import_errors((name,))
    if not errors:
        return importlib.import_module(name)
    why = required_by(environ)
    if why is not None:
        pytest.fail(message(errors, why), pytrace=False)
    pytest.skip(f"could not import {name!r}: {errors[name]}")

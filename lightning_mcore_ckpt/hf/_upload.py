"""Hub upload: a finished, verified Hugging Face export pushed with ``huggingface_hub``.

:func:`upload_export` runs in the caller's thread (the CLI): it checks the export against the
step it came from (the bytes its commit sealed, or the tensors), creates the
repository (``private`` honoured; an existing repository is reused) and uploads the folder as one
commit naming the step, retrying with backoff. :class:`HubUploader` runs it on a background
thread for a training run (rank 0): training never waits for it, and it only reads the committed
step's ``huggingface/``. The endpoint and the token are ``huggingface_hub``'s own (``HF_ENDPOINT``,
``HF_TOKEN`` or a saved login); the token is never logged.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.format.integrity import check_hashes
from lightning_mcore_ckpt.hf._refused import refused
from lightning_mcore_ckpt.hf._verify import verify_export

__all__ = ["HubUploader", "UploadError", "UploadResult", "check_upload_options", "upload_export"]

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
BACKOFF_S = 10.0
"""Seconds before the second attempt; doubled before each later one."""
# Weights of an earlier upload that this one does not have are deleted in the same commit, so
# that the repository never mixes shards of two steps.
_REPLACED = ["*.safetensors", "*.safetensors.index.json"]


class UploadError(RuntimeError):
    """An upload that failed for good (after its attempts, or refused); the step is intact.

    Example::

        try:
            upload_export(out, step, "my-org/qwen-sft")
        except UploadError as err:
            print(err)  # names the repository, the step and the last error
    """


class _Refused(Exception):
    """Not worth retrying: the export does not match its step, or the repository is public."""


@dataclasses.dataclass(frozen=True)
class UploadResult:
    """What :func:`upload_export` did: the repository, the step, the time and the attempts.

    Example::

        result = upload_export(out, step, "my-org/qwen-sft")
        print(result.commit_url, result.attempts)
    """

    repo_id: str
    step: str
    seconds: float
    attempts: int
    commit_url: str | None


def check_upload_options(
    upload_to: object, private: object, attempts: object, timeout_s: object, *, where: str
) -> None:
    """Refuse a malformed repository name or option before any work, naming the fix.

    Example::

        check_upload_options("my-org/qwen-sft", True, 3, 3600.0, where="HFExport")
    """
    if not isinstance(upload_to, str) or not _REPO_ID.match(upload_to) or ".." in upload_to:
        raise refused(
            f"{where}(upload_to={upload_to!r}): pass a Hub model repository as 'org/name' (or "
            "'user/name'): letters, digits, '-', '_' and '.', one '/', e.g. 'my-org/qwen-sft'"
        )
    if not isinstance(private, bool):
        raise refused(f"{where}(private={private!r}): pass True or False")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise refused(
            f"{where}(upload_attempts={attempts!r}): pass an int >= 1 (attempts before an "
            "upload is reported failed; 1: no retry)"
        )
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s < 0
    ):
        raise refused(
            f"{where}(upload_timeout_s={timeout_s!r}): pass a finite number of seconds >= 0 "
            "that the end of fit waits for an upload in flight"
        )


def _redact(text: str) -> str:
    # huggingface_hub's errors name URLs, not the token; this makes sure of it.
    secrets = {os.environ.get("HF_TOKEN")}
    try:
        from huggingface_hub import get_token

        secrets.add(get_token())
    except Exception:  # noqa: BLE001 - no token to hide
        pass
    for secret in secrets - {None, ""}:
        text = text.replace(str(secret), "***")
    return text


def _step_name(step: Path) -> str:
    number = layout.step_number(step)
    return step.name if number is None else layout.step_name(number)


def upload_export(
    exported: str | os.PathLike[str],
    step: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = True,
    attempts: int = 3,
    revision: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> UploadResult:
    """Push the Hugging Face directory ``exported`` of ``step`` to the Hub repository ``repo_id``.

    In order: ``exported`` is checked against ``step`` — a mismatch is never uploaded: a step's
    own ``huggingface/`` must have the bytes its export's commit sealed (any export kind), any
    other directory the step's tensors, bit-identical at its dtype (a full model); ``HfApi.create_repo(repo_id, private=private,
    exist_ok=True)``; with ``private``, an existing public repository is refused;
    ``HfApi.upload_folder`` of ``exported`` as one commit (atomic on the Hub: the repository
    shows all of it or none) whose message names the step; weights of an earlier commit that
    this one lacks are deleted in that commit. A failed call is retried after 10 s, 20 s, ...
    up to ``attempts`` in all. Raises :class:`UploadError` (naming the repository, the step
    and the last error) when every attempt failed; nothing on disk is changed.

    Example::

        upload_export("checkpoints/sft/global_step_3000/huggingface",
                      "checkpoints/sft/global_step_3000", "my-org/qwen-sft", private=True)
    """
    check_upload_options(repo_id, private, attempts, 0, where="upload_export")
    from huggingface_hub import HfApi

    folder, step_path = Path(exported).expanduser(), Path(step).expanduser()
    name = _step_name(step_path)
    start = time.perf_counter()
    api = HfApi()  # endpoint and token: HF_ENDPOINT, HF_TOKEN or the saved login
    error: BaseException | None = None
    checked = False
    for attempt in range(1, attempts + 1):
        try:
            if not checked:  # before anything is sent
                _check(folder, step_path)
                checked = True
            commit = _push(api, folder, repo_id, private, revision, name)
        except _Refused as err:
            raise UploadError(f"upload of {name} to {repo_id} refused: {err}") from None
        except Exception as err:  # noqa: BLE001 - network, server, auth: retried, then raised
            error = err
            if attempt == attempts:
                break
            delay = BACKOFF_S * 2 ** (attempt - 1)
            log.warning(
                "upload of %s to %s (%s), attempt %d/%d failed: %s; retrying in %.3gs",
                name, repo_id, api.endpoint, attempt, attempts, _describe(err), delay,
            )  # fmt: skip
            sleep(delay)
            continue
        seconds = time.perf_counter() - start
        url = getattr(commit, "commit_url", None)
        log.info(
            "uploaded %s to %s in %.1fs (%d attempt(s)): %s", name, repo_id, seconds, attempt, url
        )
        return UploadResult(repo_id, name, seconds, attempt, url)
    assert error is not None
    raise UploadError(
        f"upload of {name} ({folder}) to {repo_id} failed after {attempts} attempt(s): "
        f"{_describe(error)}; the step is intact on disk: upload it "
        f"with `lightning-mcore-ckpt export {step_path} --hf-model <model> --out <dir> "
        f"--upload-to {repo_id}`"
    ) from None


def _describe(err: BaseException) -> str:
    return _redact(f"{type(err).__name__}: {err}")


def _push(
    api: Any, folder: Path, repo_id: str, private: bool, revision: str | None, name: str
) -> Any:
    """One attempt: the repository (created, or reused unless public when ``private``), then
    ``folder`` as one commit naming the step ``name``; the commit's information."""
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if private and getattr(api.repo_info(repo_id, repo_type="model"), "private", None) is False:
        raise _Refused(
            f"{repo_id} exists and is public, and private=True was asked: make it "
            "private on the Hub, or pass private=False (--no-private)"
        )
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        revision=revision,
        commit_message=f"{name}: Hugging Face export by lightning-mcore-ckpt",
        delete_patterns=_REPLACED,
    )


def _check(folder: Path, step: Path) -> None:
    # A step's own huggingface/, sealed by the export's commit: the bytes must be the committed
    # ones (any export kind). Anything else: tensor by tensor against the step.
    if (step / layout.MODEL_DIR).is_dir() and not layout.is_complete(step):
        raise _Refused(f"{step} is not a complete step (no valid {markers.METADATA_FILE})")
    hashes = ((markers.read_metadata(step) or {}).get("hashes") or {}).items()
    sealed = {k: v for k, v in hashes if k.startswith(f"{layout.HF_DIR}/")}
    if sealed and folder.resolve() == (step / layout.HF_DIR).resolve():
        problems = check_hashes(step, sealed)
        unsealed = [p.name for p in folder.iterdir() if f"{layout.HF_DIR}/{p.name}" not in sealed]
        problems += [f"{folder / name} was added after the commit" for name in sorted(unsealed)]
        if problems:
            raise _Refused(f"{folder} is not what its export committed: {'; '.join(problems[:3])}")
        return
    try:
        result = verify_export(folder, step)
    except (FileNotFoundError, ValueError) as err:
        raise _Refused(f"{folder} cannot be checked against {step}: {err}") from err
    if not result.ok:
        found = "; ".join(result.problems[:3]) or f"largest difference {result.max_abs_diff:g}"
        raise _Refused(f"{folder} does not match {step} ({found}); it is not uploaded")


class HubUploader:
    """The Hub uploads of one training run: one background thread, one step at a time (rank 0).

    :meth:`submit` returns at once. A step submitted while another waits replaces it (the
    repository gets the newest export; the older one would be overwritten anyway); the step
    being uploaded finishes first. :meth:`steps` are the steps pending or in flight, which
    retention keeps until their upload ends. Results go to :meth:`take_outcomes` (metrics rows)
    and failures are collected for :meth:`finish` (the end of ``fit``).

    Example::

        uploader = HubUploader("my-org/qwen-sft", private=True)
        uploader.submit(Path("checkpoints/sft/global_step_3000"))
        failures = uploader.finish(timeout_s=3600)  # [] when it was uploaded
    """

    def __init__(self, repo_id: str, *, private: bool = True, attempts: int = 3) -> None:
        check_upload_options(repo_id, private, attempts, 0, where="HubUploader")
        self.repo_id, self.private, self.attempts = repo_id, private, attempts
        self._cond = threading.Condition()
        self._pending: Path | None = None
        self._active: Path | None = None
        self._outcomes: list[dict[str, Any]] = []
        self._failures: list[tuple[str, str]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, step: Path) -> None:
        """Upload ``step``'s ``huggingface/`` in the background (the export is committed)."""
        with self._cond:
            if self._pending is not None:
                log.info(
                    "upload of %s superseded by %s (not started)", self._pending.name, step.name
                )
            self._pending = step
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def steps(self) -> set[int]:
        """The step numbers pending or being uploaded."""
        with self._cond:
            paths = [p for p in (self._pending, self._active) if p is not None]
        return {n for n in map(layout.step_number, paths) if n is not None}

    def take_outcomes(self) -> list[dict[str, Any]]:
        """The finished uploads since the last call: ``global_step`` with ``hf_upload_time_s``,
        or with ``hf_upload_failed`` (1.0)."""
        with self._cond:
            taken, self._outcomes = self._outcomes, []
        return taken

    def finish(self, timeout_s: float) -> list[tuple[str, str]]:
        """Wait up to ``timeout_s`` for the uploads pending and in flight; every failure of this
        run (an upload still running at the timeout is one; it goes on in the background)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._active is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    step = self._active or self._pending
                    assert step is not None
                    self._failures.append((str(step), (
                        f"upload of {step.name} to {self.repo_id} had not finished after "
                        f"upload_timeout_s={timeout_s:g}; it goes on while this process lives "
                        f"(the step is intact on disk)"
                    )))  # fmt: skip
                    break
                self._cond.wait(left)
            failures, self._failures = self._failures, []
        return failures

    def close(self) -> None:
        """Stop after the upload in flight; a pending one is dropped (logged)."""
        with self._cond:
            self._closed = True
            for step in (self._active, self._pending):
                if step is not None:
                    log.warning(
                        "the upload of %s to %s was not finished when the run ended (the step "
                        "is intact: upload it with `lightning-mcore-ckpt export --upload-to`)",
                        step, self.repo_id,
                    )  # fmt: skip
            self._pending = None
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, self._pending = self._pending, None
                self._active = step
            number = layout.step_number(step) or 0
            try:
                result = upload_export(
                    step / layout.HF_DIR,
                    step,
                    self.repo_id,
                    private=self.private,
                    attempts=self.attempts,
                )
                outcome: dict[str, Any] = {
                    "global_step": number,
                    "hf_upload_time_s": result.seconds,
                }
                failure = None
            except Exception as err:  # noqa: BLE001 - reported at once, raised at the end of fit
                log.error("%s", err)
                outcome = {"global_step": number, "hf_upload_failed": 1.0}
                failure = (str(step), str(err))
            with self._cond:
                self._outcomes.append(outcome)
                if failure is not None:
                    self._failures.append(failure)
                self._active = None
                self._cond.notify_all()

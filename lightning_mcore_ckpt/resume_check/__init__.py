"""The resume check: prove that a job resumes exactly before spending a cluster on it.

:func:`check_resume` runs a job uninterrupted and interrupted (a clean stop, SIGTERM, a hard
kill; on simulated nodes, a kill and a wiped node's directory, which the fast tier's peer copies
must recover), resumes it with ``fit(ckpt_path="last")`` and compares, batch by batch and rank by rank,
the losses, the samples received, every RNG stream, weights, optimizer and LR scheduler state and
the loop counters; :class:`ResumeReport` names the first divergence. A run of the job that
fails to run is not a divergence: :class:`JobFailed` names the run, the ranks and the exception.
The command line ``lightning-mcore-ckpt check-resume --config run.yaml --stop-at K`` does the
same for a LightningCLI config.
"""

from lightning_mcore_ckpt.resume_check._compare import Divergence
from lightning_mcore_ckpt.resume_check._failure import JobFailure
from lightning_mcore_ckpt.resume_check._probe import ResumeProbe
from lightning_mcore_ckpt.resume_check._run import (
    InterruptionResult,
    JobFailed,
    ResumeJob,
    ResumeReport,
    check_resume,
)

__all__ = [
    "Divergence",
    "InterruptionResult",
    "JobFailed",
    "JobFailure",
    "ResumeJob",
    "ResumeProbe",
    "ResumeReport",
    "check_resume",
]

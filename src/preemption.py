"""Stopping cleanly when the cluster asks: SIGUSR1 (SLURM's warning before the time limit) or SIGTERM.

The handler only sets a flag. After each optimizer step the ranks agree through a collective (the signal
may have reached only some of them); then one checkpoint is saved and the run stops. Under SLURM, rank 0
requeues the job, which resumes from that checkpoint with resume=auto; elsewhere the process exits with
PREEMPTED_EXIT_CODE so a wrapper script can tell "saved, start me again" from success and failure.
"""

import logging
import os
import signal
import subprocess

import torch
from accelerate import Accelerator

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): temporary failure, retry later
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionWatch:
    def __init__(self):
        self.received: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum  # nothing else here: the loop decides when it is safe to stop

    def stop_agreed(self, accelerator: Accelerator) -> bool:
        """True on every rank once any rank has received a stop signal. Call on all ranks, every step."""
        if accelerator.num_processes == 1:
            return self.received is not None
        flag = torch.tensor(int(self.received is not None), device=accelerator.device)
        return bool(accelerator.reduce(flag, "sum").item())

    def describe(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal to another rank"


def requeue_slurm_job(accelerator: Accelerator) -> bool:
    """Put this SLURM job back in the queue (rank 0 only); it restarts the same batch script."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    if not job_id or not accelerator.is_main_process:
        return False
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
        return False
    log.info("requeued SLURM job %s; it will resume from the checkpoint just saved", job_id)
    return True

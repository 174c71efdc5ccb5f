"""Stopping cleanly when the cluster asks: SIGUSR1 (SLURM's warning before the time limit, as the sbatch
scripts ask for it), SIGUSR2 (the same, as submitit asks for it) or SIGTERM.

The handler only sets a flag. The ranks agree on it (the signal may have reached only some of them) in the
collective the non-finite check makes anyway (src/faults/nonfinite.py), so stopping costs no collective and no host
sync of its own: at the next step that logs, evaluates or saves (at most trainer.log_every optimizer steps
after the signal; every step where the check reads every step). Then one checkpoint is saved and the run stops.
After the warning signals, rank 0 requeues the SLURM job, which resumes from that checkpoint with
resume=auto. SIGTERM saves too but does not requeue: it is what `scancel` sends, and a job SLURM preempts with
PreemptMode=REQUEUE is requeued by SLURM itself. The process then exits with PREEMPTED_EXIT_CODE, so a wrapper
script can tell "saved, start me again" from success and failure.

Ctrl-C (SIGINT) stops the same way, without a requeue, and exits with 130 as an interrupted program does; a
second Ctrl-C ends the process at once, without a traceback. Nothing partial is ever resumed from: a save in
progress is written aside and only renamed into place when complete (src/checkpointing/save.py).
"""

import logging
import os
import signal
import subprocess
import sys

import torch
from accelerate import Accelerator

from src.faults.run_dir_lock import release_run_dirs

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): temporary failure, retry later
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # what a shell reports for a program ended by Ctrl-C
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (*REQUEUE_SIGNALS, signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    def __init__(self):
        self.received: int | None = None
        self.agreed = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            print("\nInterrupted again: stopping now, without saving. The newest complete checkpoint resumes "
                  "(resume=auto).", file=sys.stderr, flush=True)
            release_run_dirs()
            os._exit(INTERRUPTED_EXIT_CODE)
        if signum == signal.SIGINT and self.received is None and os.environ.get("RANK", "0") == "0":  # once per run
            print("\nInterrupted: finishing the step, saving a checkpoint, then stopping (Ctrl-C again: stop now, "
                  "without saving).", file=sys.stderr, flush=True)
        self.received = signum  # nothing else here: the loop decides when it is safe to stop

    def local_flag(self, device: torch.device) -> torch.Tensor:
        """This rank's vote, for the step's collective (1.0: a stop signal arrived here)."""
        return torch.tensor(float(self.received is not None), device=device)

    def agree(self, votes: float) -> None:
        """The sum of every rank's vote, as the step's collective returned it."""
        self.agreed = votes > 0

    def stop_agreed(self) -> bool:
        """True on every rank once any rank has received a stop signal (as of this step's agreement)."""
        return self.agreed

    def describe(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal to another rank"

    def exit_code(self) -> int:
        return INTERRUPTED_EXIT_CODE if self.received == signal.SIGINT else PREEMPTED_EXIT_CODE


def requeue_slurm_job(accelerator: Accelerator, preemption: PreemptionWatch) -> bool:
    """Put this SLURM job back in the queue (rank 0, after SIGUSR1/SIGUSR2); it restarts the same batch script."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    if not job_id or not accelerator.is_main_process:
        return False
    if preemption.received not in REQUEUE_SIGNALS:
        log.warning("SLURM job %s stopped on %s: not requeued (only SIGUSR1/SIGUSR2, the time-limit warning, "
                    "requeue); resume=auto in the same run dir continues from the checkpoint just saved",
                    job_id, preemption.describe())
        return False
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
        return False
    log.info("requeued SLURM job %s; it will resume from the checkpoint just saved", job_id)
    return True

"""Stopping cleanly when the cluster asks: SIGUSR1 (SLURM's warning before the time limit, as the sbatch
scripts ask for it), SIGUSR2 (the same, as submitit asks for it) or SIGTERM.

The handler only sets a flag; the loop asks `step_finished` after every optimizer step whether to stop there.
On one process that is the flag itself: the run stops after the step the signal arrived in. On several, the
ranks must agree (the signal may have reached only some of them, or each at another point of its step): each
rank's vote travels through a small all-reduce on a CPU (gloo) group in the background during the next step,
so agreeing neither waits for the device nor stalls a step, and every rank stops after the same step, the one
after the signal's. Then one checkpoint is saved and the run stops.
After the warning signals, rank 0 requeues the SLURM job, which resumes from that checkpoint with
resume=auto. SIGTERM saves too but does not requeue: it is what `scancel` sends, and a job SLURM preempts with
PreemptMode=REQUEUE is requeued by SLURM itself. The process then exits with PREEMPTED_EXIT_CODE, so a wrapper
script can tell "saved, start me again" from success and failure.

Ctrl-C (SIGINT) stops the same way, without a requeue, and exits with 130 as an interrupted program does; a
second Ctrl-C ends the process at once, without a traceback. Nothing partial is ever resumed from: a save in
progress is written aside and only renamed into place when complete (src/checkpointing/checkpointer.py).
"""

import logging
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

from src.faults.run_dir_lock import release_run_dirs
from src.launcher import launched_rank

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): temporary failure, retry later
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # what a shell reports for a program ended by Ctrl-C
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (*REQUEUE_SIGNALS, signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    def __init__(self, num_processes: int = 1):
        self.received: int | None = None
        self.agreed = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        # Every rank creates it here, as new_group requires; gloo whatever the training backend, so that a
        # vote is a host-side message and never waits on the device's queue.
        self.group = dist.new_group(backend="gloo") if num_processes > 1 else None
        self.vote, self.in_flight = torch.zeros(1), None

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            print("\nInterrupted again: stopping now, without saving. The newest complete checkpoint resumes "
                  "(resume=auto).", file=sys.stderr, flush=True)
            release_run_dirs()
            os._exit(INTERRUPTED_EXIT_CODE)
        if signum == signal.SIGINT and self.received is None and launched_rank() == 0:  # once per run
            print("\nInterrupted: finishing the step, saving a checkpoint, then stopping (Ctrl-C again: stop now, "
                  "without saving).", file=sys.stderr, flush=True)
        self.received = signum  # nothing else here: the loop decides when it is safe to stop

    def step_finished(self) -> bool:
        """Whether every rank stops after this step: the same answer on every rank, each calling it once per
        optimizer step. Several processes: the votes sent after the previous step decide, and this step's go."""
        if self.group is None:
            self.agreed = self.received is not None
            return self.agreed
        if self.in_flight is not None:
            self.in_flight.wait()  # sent a step ago: normally long arrived
            self.agreed = self.vote.item() > 0
        if not self.agreed:
            self.vote = torch.tensor([float(self.received is not None)])
            self.in_flight = dist.all_reduce(self.vote, group=self.group, async_op=True)
        return self.agreed

    def close(self) -> None:
        """Waits for the vote in flight (every rank sent one), so that none is pending when the group goes."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None

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


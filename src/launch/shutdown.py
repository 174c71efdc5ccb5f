"""Ending a run's processes cleanly: no orphaned workers, no exit-time deadlocks."""

import atexit
import gc
import logging
import os
import sys
import threading
import time
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from src.faults.preemption import PreemptionWatch, requeue_slurm_job
from src.faults.run_dir_lock import release_run_dirs
from src.launcher import launched_world_size

log = logging.getLogger(__name__)


def exit_with_the_launcher(main_process: bool, poll_s: float = 1.0) -> None:
    """A worker of torch's elastic agent (accelerate launch --multi_gpu, torchrun) ends when the agent dies.

    The agent starts each worker in its own session, so a SIGKILLed launcher (`kill -9`, an OOM kill) leaves
    the workers training on, unseen, writing into the run dir a resumed run then also writes into. A daemon
    thread notices the worker being re-parented and ends it; a signal to the agent is still forwarded as before.
    The other ranks wait two polls before they go: one leaving first would fail rank 0's next collective
    before rank 0 had noticed, and train.log (rank 0's) would not say why the run ended.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # a plain `python train.py` (or srun's own tasks) may outlive its shell by design, e.g. nohup
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.error("the launcher (pid %d) is gone: this worker (pid %d) stops rather than train on orphaned",
                  launcher, os.getpid())
        if not main_process:
            time.sleep(2 * poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def shut_down(accelerator: Accelerator) -> None:
    """Flush the trackers and destroy the process group, all ranks together (see also run_then_release).

    On one process, also forget this run's Accelerator settings, so that the next job of an in-process sweep
    (`train.py -m`, one process) may choose its own (precision, accumulation): accelerate keeps them in
    process-wide singletons, and its own tests reset them the same way. A multi-process launch is one job:
    nothing to reset, so its shutdown path stays the one its tests have long exercised."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.num_processes == 1:
        AcceleratorState._reset_state()
        GradientState._reset_state()


def outlive_main(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Keep a multi-process run's DDP model alive until the process exits, and let run_then_release end it
    with os._exit, so that its process group is never destroyed by a destructor.

    Freeing DDP's Reducer releases the last reference to the gloo process group (end_training has removed it
    from torch's registry), whose destructor joins its worker thread while holding the GIL; if that worker is
    still finishing the last collective's work, it needs the GIL to drop its tensors: a deadlock (py-spy:
    ~Reducer -> ~ProcessGroupGloo -> thread::join against ~AsyncBarrierWork -> gil_scoped_acquire). It showed
    as a rank hanging after "exported the final model", in several CI runs. At interpreter shutdown the same
    teardown could abort the process instead ("terminate called without an active exception").
    """
    if accelerator.num_processes > 1:  # atexit holds what it is given until the process ends; os._exit runs
        atexit.register(_kept_until_exit, model)  # none of its callbacks, so the model is never freed


def _kept_until_exit(*_) -> None:
    pass


def run_then_release(main: Callable[[], None]) -> None:
    """Run a @hydra.main entry point and exit with its status (e.g. PREEMPTED_EXIT_CODE, or Hydra's 1 on
    errors). A multi-process run ends with os._exit once its output is flushed (see outlive_main: everything
    it wrote is closed by then: checkpoints, exports, TensorBoard via end_training); a one-process run frees
    what it left in reference cycles and exits normally, what is left frozen: the interpreter's shutdown then
    skips the half-million objects of torch and transformers in its collections (1.1 s -> 0.3 s at exit)."""
    try:
        main()
        status = 0
    except SystemExit as exit_request:  # its traceback (and the frames holding the model) goes with this block
        status = exit_request.code
    release_run_dirs()  # also after a sys.exit (preemption), which Hydra's job-end callback does not see
    if status is None:
        status = 0
    elif not isinstance(status, int):  # sys.exit("message") prints the message and exits 1
        print(status, file=sys.stderr)
        status = 1
    if launched_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    gc.collect()
    gc.freeze()
    sys.exit(status)


def stop_preempted(accelerator: Accelerator, preemption: PreemptionWatch, run_dir) -> None:
    """After the stop's checkpoint: requeue the SLURM job (or say how to continue), close down, and exit with
    the code that tells a wrapper "saved, start me again" (or 130 after Ctrl-C)."""
    if not requeue_slurm_job(accelerator, preemption) and accelerator.is_main_process:
        log.warning("to continue: the same command with resume=auto hydra.run.dir=%s", run_dir)
    shut_down(accelerator)
    sys.exit(preemption.exit_code())

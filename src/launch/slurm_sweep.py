"""`python train.py -m hydra/launcher=submitit_slurm ...`: each sweep job a multi-process, multi-node run.

The submitit launcher (hydra-submitit-launcher) submits each job of a sweep to SLURM and runs train.py's main
in it once per node (hydra.launcher.tasks_per_node=1). That process trains nothing: it starts this node's
`accelerate launch` with slurm/launch_node.sh, the script slurm/train_multi_node.sbatch runs on each node,
with the job's own overrides, its sweep run dir and resume=auto, waits for it, and hands the run's best
trainer.monitor value back to the sweeper. Processes per node: PROCS_PER_NODE, else the node's GPUs
(hydra.launcher.gpus_per_node), as for the sbatch scripts.

Preemption: SLURM signals every process of the job (submitit asks for SIGUSR2 signal_delay_s before the time
limit). The training processes save a checkpoint and requeue the job (src/faults/preemption.py), which runs this
again and resumes in the same run dir. This process leaves the signal to them, and reports no result for
an instance SLURM is ending, which the sweeper would take as the job's final one.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src.errors import UsageError
from src.faults.preemption import PREEMPTED_EXIT_CODE, REQUEUE_SIGNALS

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]  # the repository: src/launch/ is two levels down
SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def uses_submitit_slurm(hydra_config: DictConfig) -> bool:
    return hydra_config.launcher.get("_target_") == SUBMITIT_SLURM


def check_submitit_slurm(hydra_config: DictConfig) -> None:
    """Before anything is submitted: one task per node, which starts that node's processes."""
    if uses_submitit_slurm(hydra_config) and hydra_config.launcher.tasks_per_node != 1:
        raise UsageError(
            f"hydra.launcher.tasks_per_node={hydra_config.launcher.tasks_per_node}: must be 1 with "
            "hydra/launcher=submitit_slurm. Each node runs one `accelerate launch`, which starts the node's "
            "processes: set hydra.launcher.gpus_per_node (one process per GPU), or on CPU nodes "
            "PROCS_PER_NODE=N in the environment, e.g. hydra.launcher.setup=['export PROCS_PER_NODE=2'].")


def in_submitit_slurm_job() -> bool:
    """True in the process submitit starts on each node of a sweep job (not in the training processes,
    which run train.py as a single run)."""
    hydra_config = HydraConfig.get()
    return (hydra_config.mode == RunMode.MULTIRUN and uses_submitit_slurm(hydra_config)
            and os.environ.get("SUBMITIT_EXECUTOR") == "slurm")


def launch_this_node(run_dir: Path) -> Optional[float]:
    """Train this sweep job on this node's processes; the best trainer.monitor value (node 0's answer
    is the one submitit returns to the sweeper)."""
    hydra_config = HydraConfig.get()
    ending = threading.Event()
    for sig in REQUEUE_SIGNALS:  # the training processes handle them; submitit's handler would requeue too
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: ending.set())  # SLURM is ending this job instance
    # The script's defaults first, the job's overrides after them, so the job's win (as with sbatch).
    command = [str(ROOT / "slurm" / "launch_node.sh"), str(ROOT / "train.py"), f"hydra.run.dir={run_dir}",
               "resume=auto", *hydra_config.overrides.task]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log.info("sweep job %s on node %s: %s", hydra_config.job.num, os.environ.get("SLURM_NODEID"), " ".join(command))
    code = subprocess.run(command, cwd=hydra_config.runtime.cwd, env=env).returncode
    if code == 0:
        return json.loads((run_dir / "summary.json").read_text())["best"]["value"]
    if ending.is_set() or code == PREEMPTED_EXIT_CODE:
        # Requeued after a checkpoint, or cancelled: end without a result, which the sweeper would take as
        # this job's final one (os._exit: submitit writes one on any return or exception). A requeued job
        # reports its own when it ends; a cancelled one is reported failed by submitit.
        print(f"sweep job {hydra_config.job.num}: training stopped (status {code}) after saving a checkpoint in "
              f"{run_dir}; SLURM requeues or ends this job", file=sys.stderr, flush=True)
        os._exit(PREEMPTED_EXIT_CODE)
    raise RuntimeError(f"sweep job {hydra_config.job.num}: training exited with status {code} "
                       f"(see {run_dir / 'train.log'} and this job's submitit log)")

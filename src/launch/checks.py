"""Launches that cannot work, refused before they train: fewer processes than asked for, more processes
than GPUs, ranks that disagree on the run directory, replicas that drifted apart.

Training on fewer processes than the user asked for must never be silent: N independent copies of a
run writing the same directory is the failure this module exists to prevent.
"""

import logging
import os
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from src.errors import LaunchError
from src.launch.settings import Setting, requested_processes
from src.launcher import launched_world_size, launcher_config_file, parent_launch_args

log = logging.getLogger(__name__)


def cpu_ddp_hint(n: int) -> str:
    return (
        f"accelerate launch --multi_gpu --num_processes {n} train.py ...  (or: accelerate launch --config_file "
        f"config/accelerate/cpu_ddp.yaml train.py ..., or: torchrun --nproc_per_node {n} train.py ...)"
    )


def check_gpus_per_node(local_processes: int, gpus: int) -> None:
    """More processes on a node than visible GPUs would put two ranks on one GPU, which NCCL refuses with a
    dump of its own: say so first, with the launches that fit."""
    if gpus == 0 or local_processes <= gpus:
        return
    fits = (f"accelerate launch --multi_gpu --num_processes {gpus} train.py ..." if gpus > 1
            else "accelerate launch train.py ...")
    raise LaunchError(
        f"{local_processes} processes were started on this node but it has {gpus} visible GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): one process per GPU. Launch "
        f"{fits}, or train on the CPU with {local_processes} processes: "
        f"CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes {local_processes} train.py ..."
    )


def check_process_count(accelerator: Accelerator, requested: Optional[Setting] = None) -> None:
    world_size = launched_world_size()
    if world_size > 1 and accelerator.num_processes == 1:
        raise LaunchError(
            f"The launcher started {world_size} processes (WORLD_SIZE={world_size}) but the Accelerator formed "
            f"no process group ({accelerator.distributed_type}), so each would train alone and overwrite the "
            f"others' files. Launch with: {cpu_ddp_hint(world_size)}"
        )
    if requested is None:
        args = parent_launch_args()
        requested = requested_processes(args, *(launcher_config_file(args) if args else (None, {})))
    if world_size == 1 and requested.value > 1:
        banner = "!" * 100
        log.warning(
            f"\n{banner}\nThe launcher was asked for {requested.value} processes ({requested.source}) but started "
            f"ONE: without CUDA, accelerate's launcher starts workers only with --multi_gpu or a MULTI_GPU config "
            f"(a MULTI_CPU config runs one process).\nTraining continues on 1 process. For {requested.value} "
            f"processes use:\n  {cpu_ddp_hint(requested.value)}\n{banner}"
        )


def check_same_run_dir(accelerator: Accelerator, run_dir: Path) -> None:
    """Every rank must write (and resume) the same directory; a per-node hydra.run.dir would split a run."""
    if accelerator.num_processes == 1:
        return
    main_dir = broadcast_object_list([str(run_dir)])[0]
    if main_dir != str(run_dir):
        raise LaunchError(
            f"rank {accelerator.process_index} resolved run dir {run_dir} but rank 0 resolved {main_dir}: "
            "pass the same hydra.run.dir=PATH to every process"
        )


def check_replicas_in_sync(accelerator: Accelerator, model) -> None:
    """DDP replicas must end identical; a silent divergence (e.g. a rank-dependent code path) fails here.

    Each rank reduces every parameter to a float64 sum, cheap at any scale; ranks compare the vectors.
    """
    if accelerator.num_processes == 1 or accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return  # single process, or sharded parameters: each rank holds different shards by design
    fingerprint = torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu().tolist()
    fingerprints = gather_object([fingerprint])
    log.info("parameter fingerprint per rank (sum of all parameters): %s", [sum(f) for f in fingerprints])
    if any(f != fingerprints[0] for f in fingerprints):
        raise RuntimeError("model replicas differ between ranks at the end of training")

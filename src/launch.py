"""Turning a launch (python, accelerate launch, torchrun, srun) into an Accelerator, loudly.

Training on fewer processes than the user asked for must never be silent: N independent copies of a
run writing the same directory is the failure this module exists to prevent.
"""

import gc
import logging
import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DistributedType, GradientAccumulationPlugin, broadcast_object_list, gather_object
from omegaconf import DictConfig

from src.config import UsageError

log = logging.getLogger(__name__)


def cpu_ddp_hint(n: int) -> str:
    return (
        f"accelerate launch --multi_gpu --num_processes {n} train.py ...  (or: accelerate launch --config_file "
        f"config/accelerate/cpu_ddp.yaml train.py ..., or: torchrun --nproc_per_node {n} train.py ...)"
    )


class LaunchError(UsageError):
    pass


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def processes_requested_by_parent() -> int:
    """N from a parent `accelerate launch --num_processes N` (it exports nothing that says N was asked)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or no /proc
        return 1
    # `accelerate launch ...` or `python -m accelerate.commands.launch ...`
    if not any(a.endswith("accelerate") or a == "accelerate.commands.launch" for a in argv[:3]):
        return 1
    for i, arg in enumerate(argv):
        match = re.fullmatch(r"--num[_-]processes(?:=(\d+))?", arg)
        if match:
            value = match.group(1) or (argv[i + 1] if i + 1 < len(argv) else "1")
            return int(value) if value.isdigit() else 1
    return 1


def needs_cpu_flag() -> bool:
    """Without CUDA, torchrun/--multi_gpu workers only form a process group (gloo, MULTI_CPU) with cpu=True;
    a single process keeps accelerate's own device choice (e.g. Apple MPS)."""
    return not torch.cuda.is_available() and launched_world_size() > 1


def build_accelerator(trainer: DictConfig, run_dir: Path) -> Accelerator:
    accelerator = Accelerator(
        cpu=needs_cpu_flag(),
        mixed_precision=trainer.mixed_precision.value,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=trainer.gradient_accumulation_steps,
            # Accumulation windows run across epoch ends, so every optimizer step averages exactly
            # gradient_accumulation_steps full micro-batches (no under-weighted tail window).
            sync_with_dataloader=False,
        ),
        # A seedable sampler makes the shuffle order a function of (seed, epoch): what mid-epoch resume needs.
        # non_blocking: batches copy to the GPU asynchronously from pinned memory (see src/data/base.py).
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=torch.cuda.is_available()),
        # train.py steps the LR schedule once per optimizer step itself; accelerate's default would step it
        # num_processes times per update.
        step_scheduler_with_optimizer=False,
        log_with="tensorboard",
        project_dir=str(run_dir),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=trainer.dist_timeout_s))],
    )
    quiet_other_ranks(accelerator)
    check_process_count(accelerator)
    check_same_run_dir(accelerator, run_dir)
    use_cpu_threads(accelerator, trainer.cpu_threads)
    return accelerator


def quiet_other_ranks(accelerator: Accelerator) -> None:
    # accelerate logs every file of every save at INFO; src/checkpoint.py logs one line per save instead.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    if not accelerator.is_main_process:  # their INFO lines would repeat rank 0's; warnings and errors stay
        logging.getLogger().setLevel(logging.WARNING)


def use_cpu_threads(accelerator: Accelerator, threads: int | None) -> None:
    """accelerate's launcher exports OMP_NUM_THREADS=1, which leaves all but one core idle on CPU."""
    if accelerator.device.type != "cpu":
        return
    # Under SLURM the allocation, not the machine, says how many cores are ours (CPU binding may be off):
    # oversubscribed threads make CPU reductions nondeterministic, and DDP replicas then drift apart.
    cores = int(os.environ.get("SLURM_CPUS_PER_TASK", 0)) or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    torch.set_num_threads(threads or max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def check_process_count(accelerator: Accelerator) -> None:
    world_size = launched_world_size()
    if world_size > 1 and accelerator.num_processes == 1:
        raise LaunchError(
            f"The launcher started {world_size} processes (WORLD_SIZE={world_size}) but the Accelerator formed "
            f"no process group ({accelerator.distributed_type}), so each would train alone and overwrite the "
            f"others' files. Launch with: {cpu_ddp_hint(world_size)}"
        )
    requested = processes_requested_by_parent()
    if world_size == 1 and requested > 1:
        banner = "!" * 100
        log.warning(
            f"\n{banner}\n`accelerate launch --num_processes {requested}` started ONE process: without CUDA "
            f"accelerate's launcher needs --multi_gpu or a MULTI_GPU config to start workers.\n"
            f"Training continues on 1 process. For {requested} processes use:\n  {cpu_ddp_hint(requested)}\n{banner}"
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


def describe_launch(accelerator: Accelerator, cfg: DictConfig, run_dir: Path) -> str:
    per_process = cfg.data.batch_size
    accumulation = cfg.trainer.gradient_accumulation_steps
    rows = {
        "run dir": run_dir,
        "processes": f"{accelerator.num_processes} ({accelerator.num_processes // max(1, _nodes())} per node, "
        f"{_nodes()} node(s))",
        "distributed type": accelerator.distributed_type,
        "device": f"{accelerator.device} ({torch.get_num_threads()} CPU threads per process)"
        if accelerator.device.type == "cpu" else accelerator.device,
        "mixed precision": accelerator.mixed_precision,
        "gradient accumulation steps": accumulation,
        "batch size per process": per_process,
        "global batch size": f"{per_process * accelerator.num_processes * accumulation} "
        f"(= {per_process} per process x {accelerator.num_processes} processes x {accumulation} micro-steps)",
        "optimizer steps": cfg.trainer.max_steps,
        "command": " ".join(sys.argv),
    }
    width = max(map(len, rows))
    return "\n".join(["=" * 80] + [f"{k:<{width}} : {v}" for k, v in rows.items()] + ["=" * 80])


def _nodes() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return launched_world_size() // local if local else 1


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


def shut_down(accelerator: Accelerator) -> None:
    """Flush the trackers and destroy the process group, all ranks together (see also run_then_release)."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run_then_release(main: Callable[[], None]) -> None:
    """Run a @hydra.main entry point, then free what it left in reference cycles before exiting.

    A DDP wrapper keeps the gloo process group alive inside reference cycles; if the interpreter frees it
    during shutdown, a gloo thread can abort the process ("terminate called without an active exception"),
    about 1 run in 10 here. The exit status (e.g. PREEMPTED_EXIT_CODE, or Hydra's 1 on errors) is kept.
    """
    try:
        main()
        status = 0
    except SystemExit as exit_request:  # its traceback (and the frames holding the model) goes with this block
        status = exit_request.code
    gc.collect()
    sys.exit(status)

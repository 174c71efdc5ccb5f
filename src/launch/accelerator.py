"""The Accelerator of a run, and the process-wide torch settings that go with it."""

import ctypes
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.utils import GradientAccumulationPlugin
from omegaconf import DictConfig

from src.faults.distributed_errors import port_in_use
from src.launch.checks import check_gpus_per_node, check_process_count, check_same_run_dir
from src.launch.network import choose_gloo_interface
from src.launch.settings import LaunchSettings, needs_cpu_flag
from src.launch.shutdown import exit_with_the_launcher
from src.reporting.trackers import trackers_for

log = logging.getLogger(__name__)


def loader_configuration(stateful_loaders: bool) -> DataLoaderConfiguration:
    """How accelerate prepares every loader of a run (the data benchmark's loaders too)."""
    return DataLoaderConfiguration(
        # A seedable sampler makes the shuffle order a function of (seed, epoch): what mid-epoch resume needs.
        use_seedable_sampler=True,
        # Batches copy to the GPU asynchronously from pinned memory (see src/data/base.py).
        non_blocking=torch.cuda.is_available(),
        # No dispatch: each process reads its own part of an iterable dataset (a stream's files), instead of rank 0
        # reading all of it for every process (accelerate's default for iterables).
        dispatch_batches=False,
        use_stateful_dataloader=stateful_loaders,
    )


def build_accelerator(trainer: DictConfig, settings: LaunchSettings, run_dir: Path,
                      stateful_loaders: bool = False) -> Accelerator:
    """`stateful_loaders`: the data resumes from its loader's own state (a stream, src/loop/stream_position.py):
    accelerate's loaders are then torchdata's StatefulDataLoader."""
    if torch.cuda.is_available():  # before the Accelerator starts NCCL
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    if trainer.deterministic:
        use_deterministic_kernels()  # before CUDA is touched: cuBLAS reads its workspace setting once
    choose_gloo_interface()  # several machines, a host name that resolves to loopback: gloo needs an interface
    try:
        accelerator = Accelerator(
            cpu=needs_cpu_flag(),
            # Explicit values win over the launcher's ACCELERATE_* variables: launch_settings has merged the two.
            mixed_precision=settings.mixed_precision.value,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=settings.gradient_accumulation_steps.value,
                # The loop cuts each epoch at whole global batches (src/loop/accumulation.py), before the loader's end,
                # so every optimizer step averages exactly gradient_accumulation_steps full micro-batches.
                sync_with_dataloader=False,
            ),
            dataloader_config=loader_configuration(stateful_loaders),
            # train.py steps the LR schedule once per optimizer step itself; accelerate's default would step it
            # num_processes times per update.
            step_scheduler_with_optimizer=False,
            log_with=trackers_for(list(trainer.trackers), trainer.tracker_project, run_dir),
            project_dir=str(run_dir),
            kwargs_handlers=[
                InitProcessGroupKwargs(timeout=timedelta(seconds=trainer.dist_timeout_s)),
                DistributedDataParallelKwargs(
                    find_unused_parameters=trainer.ddp_find_unused_parameters, static_graph=trainer.ddp_static_graph,
                    bucket_cap_mb=trainer.ddp_bucket_cap_mb,
                    gradient_as_bucket_view=trainer.ddp_gradient_as_bucket_view),
            ],
        )
    except torch.distributed.DistNetworkError as error:  # env:// launches: this process listens on the port
        raise port_in_use(error, os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR")) or error from None
    if accelerator.device.type == "cuda" and trainer.tf32:  # Ampere and later: ~8x fp32 matmul throughput
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if trainer.cuda_memory_fraction is not None:
        if accelerator.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(trainer.cuda_memory_fraction, accelerator.device)
        else:
            log.info("trainer.cuda_memory_fraction=%s ignored: this process runs on %s", trainer.cuda_memory_fraction,
                     accelerator.device.type)
    quiet_other_ranks(accelerator)
    check_process_count(accelerator, settings.requested_processes)
    check_same_run_dir(accelerator, run_dir)
    use_cpu_threads(accelerator, trainer.cpu_threads)
    keep_freed_memory(accelerator.device)
    exit_with_the_launcher(accelerator.is_main_process)
    return accelerator


def use_deterministic_kernels() -> None:
    """What PyTorch's reproducibility notes ask for. Seeds are not the issue: the shuffle, the loader
    workers' seeds, dropout and augmentation already follow trainer.seed (bitwise on CPU without this);
    on GPUs, atomics-based kernels (scatter_add, some convolutions' backward) and cuDNN's autotuner are."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def quiet_other_ranks(accelerator: Accelerator) -> None:
    # accelerate logs every file of every save at INFO; src/checkpointing/checkpointer.py logs one line per save.
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
    settle_vector_math()


def settle_vector_math() -> None:
    """MKL's vector math (torch's sqrt, exp, log... of a float tensor on CPU) sets itself up at its first call.
    When that first call comes from two intra-op threads at once (an op over more than 2,048 elements is split
    between them), one of them may round differently: AdamW's sqrt of a 2,080-element tensor gave other bits in
    about 1 process in 20 on a 2-core Xeon (two identical runs then differed, DDP replicas drifted apart). One
    call from this thread alone first: none in 160 (tests/test_distributed.py)."""
    torch.ones(8).sqrt()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(device: torch.device) -> bool:
    """On CPU, glibc's malloc gives the memory of a step's activations back to the system and faults it in again
    at the next step: on the default GPT, 2 000 page faults and 5 ms of system time a step, which a hand-written
    loop pays less of (scripts/BENCHMARKS.md). Fixed thresholds keep freed memory for reuse, as jemalloc or
    tcmalloc would, without a dependency: up to 256 MiB freed at the top of the heap stay with the process. Left
    alone where the user chose an allocator or glibc's malloc settings. Whether it applied them."""
    chosen = any(key.startswith("MALLOC_") for key in os.environ) or "LD_PRELOAD" in os.environ or \
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if device.type != "cpu" or chosen or not glibc():
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20) and libc.mallopt(M_TRIM_THRESHOLD, 256 * 2**20))


def glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a glibc system (macOS, musl)
        return False

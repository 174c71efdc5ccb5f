"""Turning a launch (python, accelerate launch, torchrun, srun) into an Accelerator, loudly.

Training on fewer processes than the user asked for must never be silent: N independent copies of a
run writing the same directory is the failure this module exists to prevent.
"""

import argparse
import functools
import gc
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, GradientAccumulationPlugin, broadcast_object_list, gather_object
from omegaconf import DictConfig

from src.precision import resolve_precision
from src.schema import UsageError
from src.trackers import trackers_for

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


# --- what the launcher was asked for --------------------------------------------------------------------


@functools.cache
def parent_launch_args() -> Optional[argparse.Namespace]:
    """The arguments of the `accelerate launch` that started this process, parsed by accelerate's own parser,
    or None when something else started it. (The launcher exports no variable for most of what it was asked:
    e.g. `--num_processes N` without CUDA starts one process, and `--gradient_accumulation_steps` reaches the
    script only under DeepSpeed.)"""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or no /proc
        return None
    # `accelerate launch ARGS` or `python -m accelerate.commands.launch ARGS`
    starts = [i for i, a in enumerate(argv[:4]) if a == "accelerate.commands.launch"
              or (a == "launch" and i > 0 and argv[i - 1].endswith("accelerate"))]
    if not starts:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        return launch_command_parser().parse_args([a for a in argv[starts[0] + 1:] if a != ""])
    except SystemExit:  # not parseable after all: treat as unknown
        return None


def launcher_config_file(args: argparse.Namespace) -> tuple[Optional[str], dict]:
    """The config file the launcher read (`--config_file`, else the `accelerate config` default) and its
    contents, as accelerate itself chooses it."""
    from accelerate.commands.config.config_args import default_config_file

    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) and not args.cpu else None)
    if path is None or not os.path.isfile(path):
        return None, {}
    with open(path, encoding="utf-8") as f:
        return path, yaml.safe_load(f) or {}


@dataclass
class Setting:
    value: Any
    source: str  # where the value came from, for the banner: config, launcher, environment or default


@dataclass
class LaunchSettings:
    mixed_precision: Setting
    gradient_accumulation_steps: Setting
    requested_processes: Setting


def launch_settings(trainer: DictConfig) -> LaunchSettings:
    """The effective precision and accumulation, each from the config if it sets one, else from the launcher
    (`accelerate launch --mixed_precision`, the `accelerate config` file, `--config_file`), else the default.
    A config value that contradicts an explicit launcher value is refused, naming both."""
    args = parent_launch_args()
    path, file = launcher_config_file(args) if args else (None, {})
    in_file = f"config file {path}"
    if args is not None:
        launcher_precision = (Setting(args.mixed_precision, "launcher: --mixed_precision") if args.mixed_precision
                              else Setting(file["mixed_precision"], f"launcher: {in_file}")
                              if file.get("mixed_precision") is not None else None)
        file_accumulation = (file.get("deepspeed_config") or {}).get("gradient_accumulation_steps")
        launcher_accumulation = (
            Setting(args.gradient_accumulation_steps, "launcher: --gradient_accumulation_steps")
            if args.gradient_accumulation_steps else Setting(file_accumulation, f"launcher: {in_file}")
            if file_accumulation is not None else None)
    else:  # python / torchrun: the variables accelerate's launcher would have set, if the user set them
        env_precision, env_accumulation = (os.environ.get(f"ACCELERATE_{k}") for k in
                                           ("MIXED_PRECISION", "GRADIENT_ACCUMULATION_STEPS"))
        launcher_precision = Setting(env_precision, "environment: ACCELERATE_MIXED_PRECISION") if env_precision else None
        launcher_accumulation = (Setting(int(env_accumulation), "environment: ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
                                 if env_accumulation else None)
    configured_precision = trainer.mixed_precision
    if configured_precision == "auto" and launcher_precision is not None:
        configured_precision = None  # auto defers to a precision the launcher names
    precision = _decide("trainer.mixed_precision", configured_precision, launcher_precision, "no")
    settings = LaunchSettings(
        mixed_precision=Setting(*resolve_precision(precision.value, precision.source)),
        gradient_accumulation_steps=_decide("trainer.gradient_accumulation_steps",
                                            trainer.gradient_accumulation_steps, launcher_accumulation, 1),
        requested_processes=requested_processes(args, path, file),
    )
    if settings.mixed_precision.value == "fp16" and not torch.cuda.is_available():
        raise UsageError(f"mixed precision fp16 ({settings.mixed_precision.source}) needs a CUDA GPU: on CPU "
                         "accelerate would silently train in fp32. Use bf16 or no.")
    return settings


def _decide(key: str, configured: Any, launcher: Optional[Setting], default: Any) -> Setting:
    if configured is not None and launcher is not None and str(configured) != str(launcher.value):
        raise UsageError(
            f"{key}={configured} (config) contradicts {launcher.value} ({launcher.source}). Keep one: "
            f"pass {key}=null to use the launcher's value, or launch with the value the config asks for."
        )
    if configured is not None:
        return Setting(configured, f"config: {key}")
    return launcher if launcher is not None else Setting(default, "default")


def needs_cpu_flag() -> bool:
    """Without CUDA, torchrun/--multi_gpu workers only form a process group (gloo, MULTI_CPU) with cpu=True;
    a single process keeps accelerate's own device choice (e.g. Apple MPS)."""
    return not torch.cuda.is_available() and launched_world_size() > 1


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


def build_accelerator(trainer: DictConfig, settings: LaunchSettings, run_dir: Path) -> Accelerator:
    if torch.cuda.is_available():  # before the Accelerator starts NCCL
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    if trainer.deterministic:
        use_deterministic_kernels()  # before CUDA is touched: cuBLAS reads its workspace setting once
    accelerator = Accelerator(
        cpu=needs_cpu_flag(),
        # Explicit values win over the launcher's ACCELERATE_* variables: launch_settings has merged the two.
        mixed_precision=settings.mixed_precision.value,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=settings.gradient_accumulation_steps.value,
            # The loop cuts each epoch at whole global batches (src/accumulation.py), before the loader's end,
            # so every optimizer step averages exactly gradient_accumulation_steps full micro-batches.
            sync_with_dataloader=False,
        ),
        # A seedable sampler makes the shuffle order a function of (seed, epoch): what mid-epoch resume needs.
        # non_blocking: batches copy to the GPU asynchronously from pinned memory (see src/data/base.py).
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=torch.cuda.is_available()),
        # train.py steps the LR schedule once per optimizer step itself; accelerate's default would step it
        # num_processes times per update.
        step_scheduler_with_optimizer=False,
        log_with=trackers_for(list(trainer.trackers), trainer.tracker_project, run_dir),
        project_dir=str(run_dir),
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=trainer.dist_timeout_s)),
            DistributedDataParallelKwargs(
                find_unused_parameters=trainer.ddp_find_unused_parameters, static_graph=trainer.ddp_static_graph,
                bucket_cap_mb=trainer.ddp_bucket_cap_mb, gradient_as_bucket_view=trainer.ddp_gradient_as_bucket_view),
        ],
    )
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
    exit_with_the_launcher(accelerator.is_main_process)
    return accelerator


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


def use_deterministic_kernels() -> None:
    """What PyTorch's reproducibility notes ask for. Seeds are not the issue: the shuffle, the loader
    workers' seeds, dropout and augmentation already follow trainer.seed (bitwise on CPU without this);
    on GPUs, atomics-based kernels (scatter_add, some convolutions' backward) and cuDNN's autotuner are."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


class TiedWeightNotice(logging.Filter):
    """accelerate warns "Removed shared tensor {...} while saving" at every save of a model with tied weights
    (the GPT's lm_head is its token embedding): safetensors stores a shared tensor once, and loading ties it
    again. The notice is dropped for the model's own ties only; any other shared tensor is still reported."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.tied = every - {name for name, _ in model.named_parameters()}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Removed shared tensor" not in message:
            return True
        names = set(re.findall(r"'([^']+)'", message.split("while saving")[0]))
        return not names or not names <= {key for tied in self.tied for key in (tied, f"module.{tied}")}


def hide_tied_weight_notices(model: torch.nn.Module) -> None:
    logger = logging.getLogger("accelerate.utils.other")
    for earlier in [f for f in logger.filters if isinstance(f, TiedWeightNotice)]:  # an in-process sweep's last job
        logger.removeFilter(earlier)
    logger.addFilter(TiedWeightNotice(model))


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


def requested_processes(args: Optional[argparse.Namespace], path: Optional[str], file: dict) -> Setting:
    """How many processes the launcher was asked for: --num_processes, else its config file's answer."""
    if args is None:
        return Setting(1, "default")
    if args.num_processes:
        return Setting(args.num_processes, "launcher: --num_processes")
    return Setting(file.get("num_processes") or 1, f"launcher: config file {path}")


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


def describe_launch(accelerator: Accelerator, cfg: DictConfig, settings: LaunchSettings, run_dir: Path) -> str:
    per_process = cfg.data.get("batch_size", "?")
    accumulation = settings.gradient_accumulation_steps.value
    rows = {
        "run dir": run_dir,
        "processes": f"{accelerator.num_processes} ({accelerator.num_processes // max(1, _nodes())} per node, "
        f"{_nodes()} node(s))",
        "distributed type": accelerator.distributed_type,
        "device": f"{accelerator.device} ({torch.get_num_threads()} CPU threads per process)"
        if accelerator.device.type == "cpu" else accelerator.device,
        "mixed precision": f"{accelerator.mixed_precision} ({settings.mixed_precision.source})",
        "deterministic kernels": torch.are_deterministic_algorithms_enabled(),
        "gradient accumulation steps": f"{accumulation} ({settings.gradient_accumulation_steps.source})",
        "batch size per process": per_process,
        "global batch size": f"{per_process * accelerator.num_processes * accumulation} "
        f"(= {per_process} per process x {accelerator.num_processes} processes x {accumulation} micro-steps)"
        if isinstance(per_process, int) else "?",
        "optimizer steps": cfg.trainer.max_steps,
        "model": cfg.model._target_,
        "data": cfg.data._target_,
        "objective": cfg.objective._target_,
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


# Objects whose destruction is left to the process's exit (see outlive_main).
_UNTIL_EXIT: list = []


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
    if accelerator.num_processes > 1:
        _UNTIL_EXIT.append(model)


def run_then_release(main: Callable[[], None]) -> None:
    """Run a @hydra.main entry point and exit with its status (e.g. PREEMPTED_EXIT_CODE, or Hydra's 1 on
    errors). A multi-process run ends with os._exit once its output is flushed (see outlive_main: everything
    it wrote is closed by then: checkpoints, exports, TensorBoard via end_training); a one-process run frees
    what it left in reference cycles and exits normally."""
    try:
        main()
        status = 0
    except SystemExit as exit_request:  # its traceback (and the frames holding the model) goes with this block
        status = exit_request.code
    if status is None:
        status = 0
    elif not isinstance(status, int):  # sys.exit("message") prints the message and exits 1
        print(status, file=sys.stderr)
        status = 1
    if _UNTIL_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    gc.collect()
    sys.exit(status)

"""How a run's configuration is put together and checked, before anything is built or written.

Each config group (model, data, objective, optimizer, scheduler) is a `_target_` whose signature is its
schema (src/schema.py): the defaults, types, ranges and help of `model=gpt` live in `GPT.__init__`, not here
and not in YAML. The loop's own settings are `TrainerConfig` below. `complete_config` fills every default in
and checks everything at once; `ValidateConfig`, a Hydra callback, runs it before Hydra creates the run
directory, so a mistake never leaves an empty run dir behind.
"""

import functools
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from torch.distributed import TCPStore

from src.optim import LRScaling
from src.schema import (Arg, ConfigError, UsageError, check_values, chosen_option, complete, data_size_references,
                        locate, schema_of)

__all__ = ["TrainerConfig", "complete_config", "ConfigError", "UsageError", "ValidateConfig"]


@dataclass
class TrainerConfig:
    """The loop's settings (`trainer.*`): how long, how often, how precisely."""

    max_steps: Annotated[Optional[int], Arg("optimizer steps to train for (null when max_epochs says)", ge=1)] = 2000
    max_epochs: Annotated[Optional[int], Arg(
        "passes over the training set, instead of max_steps: it then becomes max_epochs x the whole global "
        "batches of an epoch, and the LR schedule follows it (set one of the two)", ge=1)] = None
    gradient_accumulation_steps: Annotated[Optional[int], Arg(
        "micro-batches per optimizer step (null: the launcher's --gradient_accumulation_steps, else 1)", ge=1)] = None
    mixed_precision: Annotated[Optional[Literal["no", "fp16", "bf16", "auto"]], Arg(
        "autocast dtype (auto: bf16 where the device computes it natively, recent GPUs and CPUs with AVX-512-BF16 "
        "or AMX, else no; null: the launcher's --mixed_precision or `accelerate config` answer, else no)")] = None
    seed: Annotated[int, Arg("seed for model init, data order, dropout", ge=0)] = 1337
    deterministic: Annotated[bool, Arg(
        "deterministic kernels only (torch.use_deterministic_algorithms, cuDNN without autotuning, "
        "CUBLAS_WORKSPACE_CONFIG): bitwise-repeatable runs on GPUs too, at some speed; an op without a "
        "deterministic kernel then raises, naming itself")] = False
    log_every: Annotated[int, Arg("optimizer steps between train/* scalars", ge=1)] = 10
    nonfinite: Annotated[Literal["error", "skip"], Arg(
        "a NaN/inf loss or gradient norm: stop before applying it (error) or skip that optimizer step (skip)")] = "error"
    max_consecutive_skips: Annotated[int, Arg("with nonfinite=skip, stop after this many skipped steps in a row",
                                              ge=1)] = 10
    eval_every: Annotated[int, Arg("optimizer steps between evaluations (0: only at the end)", ge=0)] = 500
    limit_train_batches: Annotated[Optional[int], Arg(
        "train on the first N global batches of the training set only, an epoch being those N (debug=overfit, "
        "debug=limit; null: all)", ge=1)] = None
    eval_batches: Annotated[Optional[int], Arg(
        "evaluate on the first eval_batches x data.eval_batch_size validation samples (null: all); exact on any "
        "number of processes", ge=1)] = None
    checkpoint_every: Annotated[int, Arg("optimizer steps between checkpoints (0: only at the end)", ge=0)] = 500
    keep_last_checkpoints: Annotated[int, Arg("newest complete checkpoints kept on disk", ge=2)] = 3
    max_grad_norm: Annotated[float, Arg("clip the global gradient norm to this (0: no clipping)", ge=0)] = 1.0
    monitor: Annotated[Optional[str], Arg(
        "metric that picks the best checkpoint (null: none); one the objective reports, e.g. eval/loss")] = "eval/loss"
    monitor_mode: Annotated[Literal["min", "max"], Arg("whether the monitored metric is better low or high")] = "min"
    dist_timeout_s: Annotated[int, Arg("collective timeout: a lost peer ends the run with an error", ge=1)] = 1800
    hang_report_s: Annotated[float, Arg("no optimizer step finished for this long: every live rank logs its "
                                        "threads' stacks (before dist_timeout_s ends the run)", gt=0)] = 300.0
    early_stopping_patience: Annotated[Optional[int], Arg(
        "stop after this many evaluations in a row without improving trainer.monitor (null: never)", ge=1)] = None
    early_stopping_min_delta: Annotated[float, Arg(
        "an improvement smaller than this does not count, for early stopping", ge=0)] = 0.0
    ema_decay: Annotated[Optional[float], Arg(
        "keep an exponential moving average of the weights with this decay, e.g. 0.999: evaluated as eval_ema/*, "
        "exported to <run_dir>/model_ema, checkpointed (null: off)", gt=0, lt=1)] = None
    sync_batchnorm: Annotated[bool, Arg(
        "BatchNorm statistics over the global batch under DDP (SyncBatchNorm), not each process's share")] = False
    cuda_memory_fraction: Annotated[Optional[float], Arg(
        "cap this process's CUDA memory at this fraction of its GPU, e.g. to share one (null: no cap; ignored "
        "on CPU)", gt=0, le=1)] = None
    trackers: Annotated[tuple[Literal["tensorboard", "mlflow", "wandb"], ...], Arg(
        "where scalars are logged, through accelerate's trackers; MLflow and W&B take their storage from their own "
        "settings (MLFLOW_TRACKING_URI, WANDB_MODE=offline)")] = ("tensorboard",)
    tracker_project: Annotated[str, Arg("the MLflow experiment / W&B project the run belongs to")] = "train"
    compile: Annotated[bool, Arg(
        "torch.compile each micro-step's forward pass and loss as one graph, and evaluation")] = False
    auto_micro_batch: Annotated[bool, Arg(
        "use the largest per-process micro-batch that fits, with accumulation making up the rest, so the global "
        "batch and the loss stay exactly as configured; chosen once, saved, reused on resume")] = False
    tf32: Annotated[bool, Arg("TF32 tensor cores for fp32 matmuls and convolutions on CUDA (ignored on CPU)")] = True
    ddp_find_unused_parameters: Annotated[bool, Arg(
        "DDP: allow parameters without a gradient in a step (costs a graph traversal per step)")] = False
    ddp_static_graph: Annotated[bool, Arg("DDP: the graph is the same every step (enables more overlap)")] = False
    ddp_bucket_cap_mb: Annotated[int, Arg("DDP: gradient bucket size for the all-reduce, in MB", ge=1)] = 25
    ddp_gradient_as_bucket_view: Annotated[bool, Arg(
        "DDP: gradients are views into the all-reduce buckets (saves one gradient-sized copy)")] = False
    progress_interval_s: Annotated[float, Arg(
        "seconds between plain progress lines when stderr is not a terminal (a terminal gets a tqdm bar)", gt=0)] = 30.0
    profile: Annotated[Optional[tuple[int, int, int]], Arg(
        "[wait, warmup, active] optimizer steps of a torch.profiler trace in <run_dir>/profile (null: off)", ge=0)] = None
    peak_tflops: Annotated[Optional[float], Arg(
        "peak TFLOP/s of one device, for train/mfu (null: A100/H100/H200 known, others no MFU)", gt=0)] = None
    cpu_threads: Annotated[Optional[int], Arg(
        "intra-op threads per process on CPU (null: its share of the cores)", ge=1)] = None


# Group -> the parameters train.py passes when it builds it (so the config must not).
GROUPS = {"model": (), "data": (), "objective": (), "optimizer": ("params",), "scheduler": ("optimizer",)}


def base_config() -> DictConfig:
    """What every composition starts from: one node per group, open so that `model.n_layer=6` needs no `+`
    (unknown keys are caught by complete_config, which knows the target's parameters)."""
    cfg = OmegaConf.create({**{group: {} for group in GROUPS}, "trainer": {}, "resume": None})
    for group in (*GROUPS, "trainer"):
        OmegaConf.set_struct(cfg[group], False)
    return cfg


def complete_config(cfg: DictConfig, warnings: Optional[list[str]] = None) -> DictConfig:
    """The config with every default filled in from the signatures, or a ConfigError listing every problem.

    `${dataset:NAME}` references stay unresolved (the data is not built yet), but each must name a size the
    chosen data provides. Doubtful but legal settings are appended to `warnings` when given.
    """
    problems, completed, schemas = [], {}, {}
    data_cls = _target_class(cfg, "data", problems)
    provided = tuple(data_cls.provides()) if hasattr(data_cls, "provides") else None
    for group, supplied in GROUPS.items():
        target = OmegaConf.select(cfg, f"{group}._target_")
        if not target:
            problems.append(f"{group} has no _target_: choose an option ({group}=NAME) or set {group}._target_")
            continue
        try:
            schemas[group] = schema_of(target, skip=supplied)
        except ConfigError as error:
            problems += [f"{group}.{p}" for p in error.problems]
            continue
        if group == "optimizer":  # keys the template applies to any optimizer (src/optim.py)
            schemas[group].params.update(schema_of(LRScaling).params)
        completed[group], found = complete(cfg[group], schemas[group], f"{group}.", supplied,
                                           data_sizes=provided or () if group == "model" else ())
        problems += found
    schemas["trainer"] = schema_of(TrainerConfig)
    completed["trainer"], found = complete(cfg.trainer, schemas["trainer"], "trainer.")
    problems += found or _length_of_run(cfg.trainer, completed["trainer"])
    if problems:
        raise ConfigError(problems)

    out = OmegaConf.create({**completed, "resume": cfg.get("resume")})
    if "hydra" in cfg:  # kept for the checks' messages (option names); train.py's cfg has none
        with_hydra = OmegaConf.create({"hydra": {"runtime": {"choices": dict(cfg.hydra.runtime.choices)}}})
        out = OmegaConf.merge(out, with_hydra)
    checked = out
    if out.trainer.max_steps is None:  # by epochs: the step count exists once the data is built; until then
        checked = out.copy()  # values that follow it (the schedule's length) are checked with a stand-in
        checked.trainer.max_steps = 1
    for group, schema in schemas.items():
        problems += check_values(checked, group, schema)
    if provided is not None:
        for key, name in data_size_references(out.model, "model"):
            if name not in provided:
                problems.append(f"{key}=${{dataset:{name}}}, but data={chosen_option(out, 'data')} ({out.data._target_}) "
                                f"provides only: {', '.join(provided) or 'no sizes'}")
    if not problems:  # cross-checks assume each value is of its type
        problems += _cross_checks(out, warnings if warnings is not None else [])
    if problems:
        raise ConfigError(problems)
    if "hydra" in out:
        out.pop("hydra")
    return out


def _length_of_run(given: DictConfig, trainer: dict) -> list[str]:
    """Exactly one of max_steps (which has a default) and max_epochs says how long a run is: max_epochs given
    without max_steps replaces the default."""
    steps, epochs = trainer["max_steps"], trainer["max_epochs"]
    if epochs is None:
        return [] if steps is not None else [
            "trainer.max_steps=null needs trainer.max_epochs: give one of them, the run's length"]
    if given.get("max_steps") is not None:
        return [f"trainer.max_steps={steps} and trainer.max_epochs={epochs}: give one of them (to train by "
                "epochs, add trainer.max_steps=null)"]
    trainer["max_steps"] = None  # train.py sets it once the data and the global batch are known
    return []


def _target_class(cfg: DictConfig, group: str, problems: list[str]) -> Any:
    target = OmegaConf.select(cfg, f"{group}._target_")
    try:
        return locate(target) if target else None
    except ConfigError as error:
        problems += [f"{group}.{p}" for p in error.problems]
        return None


def _cross_checks(cfg: DictConfig, warnings: list[str]) -> list[str]:
    """Mistakes that only show between groups."""
    problems, trainer = [], cfg.trainer
    objective_cls = locate(cfg.objective._target_)
    metrics = [f"eval/{name}" for name in getattr(objective_cls, "metric_names", ("loss",))]
    if trainer.monitor is not None and trainer.monitor not in metrics:
        problems.append(f"trainer.monitor={trainer.monitor} is not a metric objective={chosen_option(cfg, 'objective')} "
                        f"({cfg.objective._target_}) reports: choose one of {', '.join(metrics)}, or null")
    data_cls = locate(cfg.data._target_)
    if getattr(data_cls, "targets_are_inputs", False) and not getattr(objective_cls, "shifts_targets", False):
        problems.append(f"data={chosen_option(cfg, 'data')} gives targets equal to the inputs (Hugging Face's labels "
                        f"convention), which objective={chosen_option(cfg, 'objective')} does not shift: the model would "
                        "learn to copy its input. Use objective=causal_lm.")
    if cfg.optimizer.scale_lr != "none" and cfg.optimizer.reference_batch is None:
        problems.append(f"optimizer.scale_lr={cfg.optimizer.scale_lr} needs optimizer.reference_batch: the global batch "
                        "(samples per optimizer step) optimizer.lr was tuned for")
    if trainer.early_stopping_patience is not None:
        if trainer.monitor is None:
            problems.append("trainer.early_stopping_patience needs trainer.monitor (the metric to watch), not null")
        if trainer.eval_every == 0:
            problems.append("trainer.early_stopping_patience needs trainer.eval_every > 0: with 0 the run evaluates "
                            "only at its end, so nothing could stop it early")
    for key in ("eval_every", "checkpoint_every"):
        if trainer.max_steps is not None and trainer[key] > trainer.max_steps:
            warnings.append(f"trainer.{key}={trainer[key]} > trainer.max_steps={trainer.max_steps}: only the end of "
                            f"the run will {'evaluate' if key == 'eval_every' else 'save a checkpoint'}")
    warmup = OmegaConf.select(cfg, "scheduler.warmup_steps")
    if isinstance(warmup, int) and trainer.max_steps is not None and warmup >= trainer.max_steps:
        warnings.append(f"scheduler.warmup_steps={warmup} >= trainer.max_steps={trainer.max_steps}: the learning "
                        "rate never leaves its warm-up")
    return problems


class ValidateConfig(Callback):
    """Stops on a configuration or launch mistake before Hydra creates the run directory (on_run_start
    precedes it), so a bad value never leaves an empty run dir behind. A mistake found later, while
    building (a missing data file), removes the run dir this launch created if nothing was written to it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._exit_on_errors(config, config.hydra.run.dir)
        self.run_dir = Path(config.hydra.run.dir)
        self.run_dir_existed = self.run_dir.exists()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if job_return.status == JobStatus.FAILED and not getattr(self, "run_dir_existed", True):
            try:
                self.run_dir.rmdir()  # only ever removes an empty directory
            except OSError:
                pass

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Each job's own values are checked by train.py; the launcher's settings before anything is submitted.
        self._exit_on_errors(config, config.hydra.sweep.dir, multirun=True)

    @staticmethod
    def _exit_on_errors(config: DictConfig, run_dir: str, multirun: bool = False) -> None:
        from src.launch import launch_settings  # here: src.launch imports torch.distributed pieces
        from src.slurm_sweep import check_submitit_slurm

        warnings = []
        try:
            check_run_dir_can_be_made(run_dir)
            if multirun:
                check_submitit_slurm(config.hydra)
            launch_settings(complete_config(config, warnings).trainer)
            for warning in warnings:
                print(f"Warning: {warning}", file=sys.stderr)
        except UsageError as error:
            print(error, file=sys.stderr)
            # Hydra turns a callback's exceptions into warnings and carries on; SystemExit is not an Exception.
            raise SystemExit(1)
        except Exception:  # a bug in a check must not let the run start unchecked
            traceback.print_exc()
            raise SystemExit(1)


def check_run_dir_can_be_made(run_dir: str) -> None:
    """Refuse a run directory that cannot be created or written, before Hydra tries to."""
    existing = Path(run_dir).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    what = "is not a directory" if not existing.is_dir() else None
    if what is None:
        try:  # a real probe: permission bits say little to root, or on read-only and special filesystems
            os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=existing))
        except OSError as error:
            what = f"is not writable ({error.strerror})"
    if what:
        raise UsageError(f"hydra.run.dir={run_dir} cannot be created: {existing} {what}. Choose another "
                         "hydra.run.dir (or run from a writable working directory for the default outputs/...).")


# --- a run directory every rank agrees on ---------------------------------------------------------------


@functools.cache
def shared_timestamp() -> str:
    """This launch's start time, the same string on every rank of a torchrun / accelerate launch.

    Each rank runs @hydra.main itself, so `${now:}` could name a different directory per rank. Under the
    torch elastic agent (torchrun, `accelerate launch --multi_gpu`) every worker can reach the agent's
    key-value store at MASTER_ADDR:MASTER_PORT: the first rank to get there writes its timestamp, and
    everyone (including a restarted worker of the same launch) reads that one.
    """
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return stamp
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("MASTER_PORT") in (None, "0"):
        raise UsageError(
            "This multi-process launch has no shared store to agree on a timestamped run directory: "
            "pass hydra.run.dir=PATH (the same on every process)."
        )
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=30))
    return store.compare_set("template/run_timestamp", "", stamp).decode()


ConfigStore.instance().store(name="train_base", node=base_config())
OmegaConf.register_new_resolver("shared_timestamp", shared_timestamp, use_cache=True, replace=True)

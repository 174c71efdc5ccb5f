"""Checkpoints that never lose a run.

Layout of a run directory:
    checkpoints/step_00000500/    complete checkpoints only (written elsewhere, then renamed into place)
        model.safetensors, optimizer.bin, scheduler.bin, [scaler.pt], random_states_<rank>.pkl
                                  (accelerate.save_state; every rank writes its own RNG state)
        train_state.json          step, epoch, position in the epoch, best metric (ours: JSON, no pickle)
        run_config.yaml           the resolved config the run was started with
    checkpoints/.tmp-step_.../    a save in progress; never resumed from, removed by the next save

Why not accelerate's own rotation: `ProjectConfiguration(total_limit=K)` deletes old folders before the
new one is written and nothing is atomic, so a kill during a save can leave no loadable checkpoint.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import load as safe_load, set_seed
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import load_model

from src.schema import UsageError, data_sizes_unresolved, flatten
from src.train_state import TrainState, improves

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"step_(\d+)")
STATE_FILE = "train_state.json"
CONFIG_FILE = "run_config.yaml"
RUN_CONFIG = "config.yaml"  # what train.py writes at the top of the run dir
# Keys a resumed run may change: they do not alter what is being trained, only how long and how it reports.
SAFE_ON_RESUME = {
    "resume", "trainer.max_steps", "trainer.max_epochs", "trainer.log_every", "trainer.eval_every", "trainer.checkpoint_every",
    "trainer.keep_last_checkpoints", "trainer.dist_timeout_s", "trainer.cpu_threads", "data.num_workers",
    "trainer.trackers", "trainer.tracker_project",
}
DATA_SIZE_PLACEHOLDER = "${dataset:"
# How the global batch is split may change (e.g. a requeued job given fewer GPUs): load_checkpoint checks
# that the global batch itself does not.
LAYOUT_ON_RESUME = {"data.batch_size", "trainer.gradient_accumulation_steps"}
# null in a config means "the launcher decides"; a checkpoint records the value that was in effect.
LAUNCHER_SETTABLE = {"trainer.mixed_precision", "trainer.gradient_accumulation_steps"}


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (a step_N name exists only once its contents do)."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.fullmatch(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


# --- choosing what to resume from ---------------------------------------------------------------------


def resume_source(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint this run continues from, or None for a fresh start; refuses to clobber another run.

    resume=null: a fresh run, refused if the run dir already holds a run (its config.yaml or checkpoints).
    resume=auto: the newest complete checkpoint in the run dir, or a fresh start when there is none.
    resume=PATH: that checkpoint (checkpoints/step_N) or the newest complete one of that run dir.
    """
    if resume is None:
        if (run_dir / RUN_CONFIG).exists() or complete_checkpoints(run_dir):
            raise UsageError(
                f"{run_dir} already holds a run. To continue it: add resume=auto. To start a new run: "
                "pick another directory with hydra.run.dir=PATH (or omit it for a fresh timestamped one)."
            )
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if STEP_DIR.fullmatch(path.name) and path.is_dir():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise UsageError(f"resume={resume}: not a checkpoint directory (checkpoints/step_N) nor a run dir with one")
    return found[-1]


def config_for_resume(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """The checkpoint's config, plus the command line's safe overrides; any other change is refused.

    Only what the command line names is compared (a key and everything under it; a name the config does
    not have, such as experiment=..., can change anything, so then everything), so re-running the same
    command (e.g. a requeued SLURM job) resumes, while YAML defaults edited since do not leak in.
    """
    saved = OmegaConf.load(checkpoint / CONFIG_FILE)
    new_leaves, old_leaves = _leaves(cfg), _leaves(saved)
    named = [override.split("=", 1)[0].lstrip("+~") for override in overrides]
    scopes = [key if any(_under(leaf, key) for leaf in new_leaves) else "" for key in named]
    refused, changed = [], []
    if old_leaves.get("trainer.auto_micro_batch") and _per_process_samples(new_leaves) == _per_process_samples(old_leaves):
        # The checkpoint's micro-batch and accumulation were chosen to fit; the configured product stands.
        new_leaves.update({key: old_leaves[key] for key in ("data.batch_size", "trainer.gradient_accumulation_steps")})
    for leaf in sorted(new_leaves.keys() | old_leaves.keys()):
        new, old = new_leaves.get(leaf), old_leaves.get(leaf)
        if isinstance(new, str) and new.startswith(DATA_SIZE_PLACEHOLDER):
            continue  # derived from the data; the checkpoint's model has the value it was built with
        if (new is None or new == "auto") and leaf in LAUNCHER_SETTABLE:
            continue  # the checkpoint's value stands; launch_settings then checks the launcher against it
        if new == old or not any(_under(leaf, scope) for scope in scopes):
            continue
        if leaf in SAFE_ON_RESUME | LAYOUT_ON_RESUME:
            OmegaConf.update(saved, leaf, new, force_add=True)
            changed.append(f"{leaf}: {old} -> {new}")
        else:
            refused.append(f"{leaf}={new} (the checkpoint has {old})")
    if refused:
        raise UsageError(
            f"Cannot resume from {checkpoint} with a different model or setup:\n  " + "\n  ".join(refused)
            + f"\nOnly these may change on resume: {', '.join(sorted(SAFE_ON_RESUME | LAYOUT_ON_RESUME))} "
            f"({' and '.join(sorted(LAYOUT_ON_RESUME))} only while the global batch stays the same). "
            "Start a new run (another hydra.run.dir) to change anything else."
        )
    if "trainer.max_steps" in named and saved.trainer.get("max_epochs") is not None and cfg.trainer.max_steps:
        saved.trainer.max_epochs = None  # a length in steps replaces the checkpoint's length in epochs
        changed.append(f"trainer.max_epochs: {old_leaves['trainer.max_epochs']} -> None")
    for line in changed:
        log.warning("resume: override accepted: %s", line)
    return saved


def _per_process_samples(leaves: dict) -> Optional[int]:
    batch, accumulation = leaves.get("data.batch_size"), leaves.get("trainer.gradient_accumulation_steps") or 1
    return batch * accumulation if isinstance(batch, int) else None


def _leaves(cfg: DictConfig) -> dict:
    """full.key -> value of every leaf (lists count as one value), resolved, enums as names."""
    with data_sizes_unresolved():
        return flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def _under(leaf: str, scope: str) -> bool:
    return scope == "" or leaf == scope or leaf.startswith(scope + ".")


# --- saving -------------------------------------------------------------------------------------------


class Checkpointer:
    """Owns the checkpoint lifecycle: the loop reports what happened after each optimizer step, and this
    decides what to save. Atomic, rotated `accelerator.save_state` checkpoints: periodic ones, the best one
    by `trainer.monitor` (kept apart from rotation, with its model exported), one when a stop is agreed
    (preemption), and the final one."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, cfg: DictConfig, export: Callable[[Path], None]):
        self.accelerator = accelerator
        self.run_dir, self.root = run_dir, run_dir / "checkpoints"
        self.cfg = cfg
        self.export = export  # writes the current model to a directory (all ranks call it)
        trainer = cfg.trainer
        self.keep_last, self.every, self.max_steps = trainer.keep_last_checkpoints, trainer.checkpoint_every, trainer.max_steps
        self.monitor, self.mode = trainer.monitor, trainer.monitor_mode

    def step_finished(self, state: TrainState, metrics: Optional[dict[str, float]] = None,
                      stopping: bool = False) -> None:
        """Every rank calls this after every optimizer step, with the step's evaluation metrics if any."""
        if metrics is not None and self._improved(metrics, state):
            self.save(state)
            self.export(self.run_dir / "model_best")
        if self.saves_at(state.step) or stopping:
            self.save(state)

    def saves_at(self, step: int) -> bool:
        """Whether step `step` saves whatever happens (periodic, final); besides, an evaluation may save the
        best, and an agreed stop saves."""
        return bool(self.every and step % self.every == 0) or step >= self.max_steps

    def _improved(self, metrics: dict[str, float], state: TrainState) -> bool:
        """Whether `metrics` beat the best monitored value so far; if so, `state` records it."""
        if self.monitor is None:
            return False
        value = metrics[self.monitor]
        if not improves(value, state.best_metric, self.mode):  # a NaN or infinite metric is never the best
            return False
        state.best_metric, state.best_step = value, state.step
        return True

    def save(self, state: TrainState) -> Path:
        """Every rank must call this (save_state has each rank write its RNG state)."""
        accelerator, final = self.accelerator, self.root / step_dir_name(state.step)
        if final.exists():  # e.g. the best checkpoint and the periodic one fall on the same step
            return final
        started = time.perf_counter()
        tmp = self.root / f".tmp-{final.name}"
        if accelerator.is_main_process:
            for stale in self.root.glob(".tmp-*"):  # left by a run killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        failure = None
        try:
            accelerator.save_state(str(tmp))
            if accelerator.is_main_process:
                (tmp / STATE_FILE).write_text(json.dumps(state.state_dict(), indent=2))
                OmegaConf.save(self.cfg, tmp / CONFIG_FILE, resolve=True)
        except Exception as error:  # a full or unwritable disk shows as OSError, RuntimeError or a library's own
            failure = error
        self._stop_if_any_rank_failed(failure, tmp)
        accelerator.wait_for_everyone()  # every rank's files are in tmp before it becomes a checkpoint
        if accelerator.is_main_process:
            _fsync_tree(tmp)
            tmp.rename(final)  # the commit point: atomic on POSIX filesystems
            size_mb = _tree_size(final) / 2**20
            log.info("saved checkpoint %s (%.1f MB) in %.2f s", final, size_mb, time.perf_counter() - started)
            self._rotate(state)
        accelerator.wait_for_everyone()
        return final

    def _stop_if_any_rank_failed(self, failure: Optional[Exception], tmp: Path) -> None:
        """All ranks learn whether any rank's save failed, so none waits at a barrier; the partial save is
        removed and the newest complete checkpoint stays the one to resume from."""
        failed = torch.tensor(float(failure is not None), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            failed = self.accelerator.reduce(failed, "max")
        if not failed.item():
            return
        previous = complete_checkpoints(self.run_dir)
        needed = f"about {_tree_size(previous[-1]) / 2**20:.1f} MB (the size of the previous one)" if previous \
            else "unknown"
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(self.root).free / 2**20  # with the partial save gone
        cause = f" ({type(failure).__name__}: {failure})" if failure is not None else " (on another rank)"
        raise UsageError(
            f"Could not write checkpoint {tmp.with_name(tmp.name.removeprefix('.tmp-'))}{cause}. A checkpoint needs "
            f"{needed}; {free:.1f} MB are free on that filesystem. "
            + (f"The newest complete checkpoint, {previous[-1]}, is intact: free some space, then resume=auto."
               if previous else "No earlier checkpoint exists.")
        )

    def _rotate(self, state: TrainState) -> None:
        """Delete the oldest complete checkpoints beyond keep_last; the best one is kept apart."""
        keep = {step_dir_name(state.best_step)} if state.best_step is not None else set()
        rotating = [p for p in complete_checkpoints(self.run_dir) if p.name not in keep]
        for old in rotating[: max(0, len(rotating) - self.keep_last)]:
            shutil.rmtree(old)
            log.info("removed old checkpoint %s", old)


def _fsync_tree(directory: Path) -> None:
    """Every file and directory of a checkpoint on disk before it is renamed into place (sharded states are
    directories of files: FSDP's pytorch_model_fsdp_0/, optimizer_0/)."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)  # the directory's entries too
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tree_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


# --- loading ------------------------------------------------------------------------------------------


# What accelerate.save_state writes for the model and the optimizer: a file, or under FSDP's sharded state
# dict a torch.distributed.checkpoint directory (.metadata + .distcp shards).
MODEL_STATES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp_0.bin", "pytorch_model_fsdp_0")
OPTIMIZER_STATES = ("optimizer.bin", "optimizer_0.bin", "optimizer_0")


def check_readable(checkpoint: Path) -> None:
    """A clear error naming the file for a truncated or corrupt checkpoint, before anything is loaded.

    The CRC check reads every torch file once more, deliberately: torch.load does not verify CRCs, so a
    file corrupted in the middle would otherwise load silently (verified: 16 bad bytes in optimizer.bin).
    """
    for alternatives in (MODEL_STATES, OPTIMIZER_STATES, ("scheduler.bin",), (STATE_FILE,), (CONFIG_FILE,)):
        if not any((checkpoint / name).exists() for name in alternatives):
            raise UsageError(f"checkpoint {checkpoint} is incomplete: {checkpoint / alternatives[0]} is missing"
                             + (f" (nor {', '.join(alternatives[1:])})" if len(alternatives) > 1 else ""))
    for file in sorted(checkpoint.iterdir()):
        try:
            if file.is_dir():
                _check_sharded_state(file)
            elif file.suffix == ".safetensors":
                with safe_open(file, framework="pt"):  # validates the header against the file size
                    pass
            elif file.suffix in (".bin", ".pt", ".pkl"):
                with zipfile.ZipFile(file) as archive:  # torch.save's format; truncation breaks its index
                    if archive.testzip() is not None:
                        raise ValueError("CRC mismatch")
            elif file.suffix == ".json":
                json.loads(file.read_text())
        except Exception as error:
            raise UsageError(f"checkpoint file {file} is corrupt or truncated ({error}); "
                             f"resume from an older checkpoint with resume=PATH") from error


def _check_sharded_state(directory: Path) -> None:
    """A torch.distributed.checkpoint directory: its metadata loads, and every shard holds the bytes it lists."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory / '.metadata'} is missing")
    needed: dict[str, int] = {}
    for info in FileSystemReader(str(directory)).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = directory / name
        actual = shard.stat().st_size if shard.is_file() else None
        if actual is None or actual < size:
            raise ValueError(f"shard {shard} holds {actual or 0} bytes, the metadata lists {size}")


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, state: TrainState, seed: int) -> None:
    """Restore model, optimizer, scheduler, scaler, RNG states and counters (after accelerator.prepare).

    `state` holds this launch's layout; the checkpoint may have been written by another one of the same
    global batch (src/accumulation.py: every step then sees the same samples).
    """
    check_readable(checkpoint)
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    same_layout = _check_layout(saved, state, checkpoint)
    rng_file = checkpoint / f"random_states_{accelerator.process_index}.pkl"
    if same_layout and not rng_file.is_file():
        raise UsageError(f"{rng_file} is missing: the random state of rank {accelerator.process_index} cannot be "
                         "restored, so resuming would not be exact")
    with _model_must_fit(checkpoint):
        accelerator.load_state(str(checkpoint))  # loads with torch.load(weights_only=True)
    if same_layout:
        # accelerate only logs "Could not load random states" at INFO when RNG restore fails: verify it.
        if not torch.equal(torch.get_rng_state(), safe_load(rng_file)["torch_manual_seed"]):
            raise RuntimeError(f"the RNG state in {rng_file} was not restored; resuming would not be exact")
    elif not rng_file.is_file():  # a rank the writing run did not have: its own stream, not rank 0's copy
        set_seed(seed + 1_000_003 * (saved["step"] + 1) + accelerator.process_index)
    state.load_state_dict({key: value for key, value in saved.items() if key in POSITION_KEYS})
    log.info("resumed from %s at step %d (epoch %d, %d samples in)", checkpoint, state.step, state.epoch,
             state.samples_into_epoch)


POSITION_KEYS = ("step", "epoch", "samples_into_epoch", "best_metric", "best_step", "early_stopping_best",
                 "evals_without_improvement")


def _check_layout(saved: dict, state: TrainState, checkpoint: Path) -> bool:
    """Whether the checkpoint was written on this launch's layout; refuses another global batch."""
    if "samples_into_epoch" not in saved:  # written before positions were kept in samples: same layout assumed
        saved["samples_into_epoch"] = saved.pop("batches_into_epoch", 0) * state.batch_size * state.num_processes
        return True
    written = TrainState(**{key: saved[key] for key in ("batch_size", "num_processes", "gradient_accumulation_steps")})
    if written.global_batch != state.global_batch:
        per_micro_step = state.batch_size * state.num_processes
        keep = (f"trainer.gradient_accumulation_steps={written.global_batch // per_micro_step} keeps it on "
                f"{state.num_processes} process(es)" if written.global_batch % per_micro_step == 0 else
                f"no accumulation keeps it with data.batch_size={state.batch_size} on {state.num_processes} "
                f"process(es): choose data.batch_size x processes x trainer.gradient_accumulation_steps = "
                f"{written.global_batch}")
        raise UsageError(
            f"Cannot resume {checkpoint} with another global batch: it was trained with {written.global_batch} "
            f"samples per optimizer step ({written.layout()}), this launch has {state.global_batch} "
            f"({state.layout()}). {keep}."
        )
    if (written.batch_size, written.num_processes) == (state.batch_size, state.num_processes):
        return True
    log.warning(
        "resume: the checkpoint was written with %s, this launch has %s. The global batch is the same, so every "
        "optimizer step sees the same samples as it would have; randomness drawn per process (dropout, "
        "augmentation from the global RNG) continues statistically, not bitwise, the same.",
        written.layout(), state.layout())
    return False


@contextlib.contextmanager
def _model_must_fit(checkpoint: Path):
    """torch's size-mismatch or missing-key error, as one paragraph naming the checkpoint and the tensors."""
    try:
        yield
    except RuntimeError as error:
        if "Error(s) in loading state_dict" not in str(error):
            raise
        details = [line.strip().rstrip(".") for line in str(error).splitlines()[1:] if line.strip()]
        raise UsageError(
            f"checkpoint {checkpoint} does not fit the model its config builds: {'; '.join(details[:3])}"
            + (f" (and {len(details) - 3} more)" if len(details) > 3 else "")
            + ". The model's code has changed since the checkpoint was written: resume with the code that wrote it "
            "(its commit), or start a new run."
        ) from None


def run_config_for(path: Path) -> DictConfig:
    """The training config that produced an exported model or checkpoint (for eval.py)."""
    for candidate in (path / CONFIG_FILE, path.parent / RUN_CONFIG, path.parent.parent / RUN_CONFIG):
        if candidate.is_file():
            cfg = OmegaConf.load(candidate)
            if "data" in cfg:
                return cfg
    raise UsageError(f"path={path}: no training config found (looked for {CONFIG_FILE} in it and "
                     f"{RUN_CONFIG} in its run dir)")


def load_checkpointed_model(checkpoint: Path, run_cfg: DictConfig) -> torch.nn.Module:
    """The model of a checkpoint, rebuilt from its run's config alone (data-derived sizes are saved resolved)."""
    check_readable(checkpoint)
    model = instantiate(run_cfg.model, _convert_="all")
    with _model_must_fit(checkpoint):
        load_model(model, checkpoint / "model.safetensors", strict=True)
    return model.eval()

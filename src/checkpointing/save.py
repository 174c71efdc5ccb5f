"""Saving checkpoints atomically (written aside, fsynced, renamed into place) and rotating old ones."""

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from omegaconf import DictConfig, OmegaConf

from src.checkpointing.layout import CONFIG_FILE, DATA_FILE, STATE_FILE, complete_checkpoints, step_dir_name
from src.loop.train_state import TrainState, improves
from src.schema.errors import UsageError

log = logging.getLogger(__name__)


class Checkpointer:
    """Owns the checkpoint lifecycle: the loop reports what happened after each optimizer step, and this
    decides what to save. Atomic, rotated `accelerator.save_state` checkpoints: periodic ones, the best one
    by `trainer.monitor` (kept apart from rotation, with its model exported), one when a stop is agreed
    (preemption), and the final one."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, cfg: DictConfig, export: Callable[[Path], None],
                 data_fingerprint: dict):
        self.accelerator = accelerator
        self.run_dir, self.root = run_dir, run_dir / "checkpoints"
        self.cfg, self.data_fingerprint = cfg, data_fingerprint
        self.export = export  # writes the current model to a directory (all ranks call it)
        trainer = cfg.trainer
        self.keep_last, self.every, self.max_steps = trainer.keep_last_checkpoints, trainer.checkpoint_every, trainer.max_steps
        self.monitor, self.mode = trainer.monitor, trainer.monitor_mode

    def step_finished(self, state: TrainState, metrics: Optional[dict[str, float]] = None,
                      stopping: bool = False) -> None:
        """Every rank calls this after every optimizer step, with the step's evaluation metrics if any."""
        if metrics is not None and self._improved(metrics, state):
            # The export first: a kill between the two then resumes from an earlier checkpoint, whose best is
            # older, so this step improves again and exports again. The other way round, a checkpoint that
            # already records this step as the best would never redo an export the kill cut short.
            self.export(self.run_dir / "model_best")
            self.save(state)
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
                (tmp / DATA_FILE).write_text(json.dumps(self.data_fingerprint, indent=2))
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

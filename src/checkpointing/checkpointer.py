"""The one owner of a run's checkpoints: which one it resumes, loading it, every save, the best model and
the exports (torchtitan's CheckpointManager, at template scale).

train.py calls `load(state)` once after `accelerator.prepare`, `step_finished(...)` after every optimizer step,
and `export_final()` at the end; the checkpointer decides the rest. The config's part of resuming (which
checkpoint, and its saved config with the safe overrides) is decided before the model exists, in
`resume_point`, which src/run.py calls.

A save is atomic: the training's state (src/checkpointing/training_state.py: safetensors and JSON, nothing
pickled) and ours (train_state.json, the config, the data's fingerprint, the EMA) are written into
`checkpoints/.tmp-step_N`, rank 0 records a checksum of each of its files, every file is fsynced, and the folder is
renamed into place, so a kill at any moment leaves the newest complete checkpoint as the one to resume from
(src/checkpointing/layout.py). With trainer.async_checkpoint a periodic or best save holds the loop only while
the state is copied to host memory (each rank writes its small random state at once); rank 0's thread then
writes the files, fsyncs them and renames the folder (the commit) while training goes on. The next save, the
final one, a stop's one and the export wait for it first, and a commit that failed stops every rank there.
Under FSDP each rank's shards go through torch.distributed.checkpoint's async_save instead: each rank copies its
shards to host memory at the step, and a thread of each rank writes them, coordinating over a process group of
its own (gloo), not the loop's; rank 0's commit waits for its writes, which end only once every rank's shards
are written (DCP's finishing step gathers them).
"""

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_model

from src.checkpointing.checksums import write_checksums
from src.checkpointing.export import export_model
from src.checkpointing.integrity import check_readable
from src.checkpointing.layout import CONFIG_FILE, DATA_FILE, EMA_FILE, STATE_FILE, complete_checkpoints, step_dir_name
from src.checkpointing.load import load_checkpoint, seed_this_ranks_stream
from src.checkpointing.plain_state import save_tree
from src.checkpointing.resume import config_for_resume, resume_source, set_aside_later_checkpoints
from src.checkpointing.training_state import (
    BASE_FILE,
    base_weights,
    check_supported,
    frozen_parameters,
    main_states,
    objective_state_file,
    save_random_states,
    save_sharded,
    sharded,
    write_main_states,
)
from src.errors import LaunchError, UsageError
from src.loop.stream_position import StreamPosition
from src.loop.train_state import TrainState, improves
from src.optim.schedules import decay_begins
from src.reporting.telemetry import resident_peak

log = logging.getLogger(__name__)


def record_export(run_dir: Path, seconds: float, peaks: list[Optional[float]]) -> None:
    """The final export's time and each rank's peak resident memory while it ran, added to summary.json (a scale
    run reads there what the export costs beside what training did)."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return
    summary = json.loads(summary_file.read_text())
    summary["export"] = {"seconds": round(seconds, 2),
                         "peak_rss_gib_per_rank": [None if p is None else round(p, 3) for p in peaks]}
    tmp = summary_file.with_name(summary_file.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(summary_file)


def resume_point(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> tuple[Optional[Path], DictConfig]:
    """The checkpoint a run continues from (None: a fresh start) and the config it continues with: the
    checkpoint's own, plus the command line's overrides that are safe on a resume (src/checkpointing/resume.py)."""
    checkpoint = resume_source(cfg.resume, run_dir)  # refuses to write into another run's directory
    if checkpoint:
        check_readable(checkpoint)  # whole, uncorrupted, no pickle-format file: before its config is read
    return (checkpoint, config_for_resume(cfg, checkpoint, overrides)) if checkpoint else (None, cfg)


def agreed_resume_point(accelerator: Accelerator, checkpoint: Optional[Path], cfg: DictConfig) -> Optional[Path]:
    """Rank 0's checkpoint, which every rank continues from. Each rank chose one by listing the run dir before the
    processes could talk (the choice decides how they connect); on a network filesystem that caches directory
    entries (NFS) a rank can list another newest checkpoint than rank 0, or none. A rank whose choice gave the same
    config takes rank 0's; any other disagreement stops the launch, naming both, rather than resume two steps."""
    if accelerator.num_processes == 1:
        return checkpoint
    from accelerate.utils import broadcast_object_list

    mine = [str(checkpoint) if checkpoint else None, OmegaConf.to_yaml(cfg)]
    chosen, config = broadcast_object_list([mine if accelerator.is_main_process else None])[0]
    if chosen == mine[0]:
        return checkpoint
    if config != mine[1]:  # that rank stops; the launcher stops the others, as for another run dir
        raise LaunchError(f"rank {accelerator.process_index} would resume from {mine[0] or 'no checkpoint'} and rank 0 "
                          f"from {chosen or 'no checkpoint'}, with another config: the ranks do not see the same "
                          "run dir. Give every rank the same view of it (NFS: mount it with lookupcache=positive or "
                          "actimeo=0) or name the checkpoint with resume=PATH")
    log.warning("resume: rank %d saw %s in the run dir, rank 0 %s (a network filesystem's cached directory "
                "listing?): continuing from rank 0's", accelerator.process_index, mine[0] or "no checkpoint",
                chosen or "no checkpoint")
    if chosen is not None:
        check_readable(Path(chosen))
    return Path(chosen) if chosen else None


class Checkpointer:
    """Periodic checkpoints (trainer.checkpoint_every, rotated to trainer.keep_last_checkpoints), the best one
    by trainer.monitor (kept apart from rotation, its model exported to model_best/), one where a WSD schedule's
    decay starts (kept apart too), one when a stop is agreed (preemption, early stopping) and the final one; the
    exports model/ and model_ema/ at the end."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, cfg: DictConfig, model: Optional[torch.nn.Module],
                 ema=None, codec=None, data_fingerprint: Optional[dict] = None, resume_from: Optional[Path] = None,
                 data_changed: bool = False, progress: Callable[[str], None] = lambda doing: None,
                 position: Optional[StreamPosition] = None, objective_state: Callable[[], dict] = dict):
        check_supported(accelerator)
        self.position = position  # a stream's loader position, saved by every rank (src/loop/stream_position.py)
        self.objective_state = objective_state  # what the objective keeps, saved by every rank (Objective.rank_state)
        self.accelerator, self.cfg = accelerator, cfg
        self.progress = progress  # the hang watch hears of each part of a save and an export
        self.run_dir, self.root = run_dir, run_dir / "checkpoints"
        self.model, self.ema, self.codec = model, ema, codec
        # Weights that do not train and that every start reads from model.pretrained again (a LoRA adapter's base)
        # stay out of checkpoints; the folder's weight files are recorded instead.
        unwrapped = accelerator.unwrap_model(model) if model is not None else None
        self.without_frozen = bool(cfg.model.get("pretrained")) and unwrapped is not None and bool(
            frozen_parameters(unwrapped))
        # Rank 0 writes it with each checkpoint: the others never hash the base.
        self.base = base_weights(unwrapped) if self.without_frozen and accelerator.is_main_process else None
        self.data_fingerprint = data_fingerprint or {}
        self.resume_from, self.data_changed = resume_from, data_changed
        trainer = cfg.trainer
        self.keep_last, self.every, self.max_steps = (trainer.keep_last_checkpoints, trainer.checkpoint_every,
                                                      trainer.max_steps)
        self.monitor, self.mode, self.seed = trainer.monitor, trainer.monitor_mode, trainer.seed
        # Where a WSD schedule's decay starts: its checkpoint there, kept apart from rotation, trains any longer run.
        self.decay_from = decay_begins(cfg.scheduler) if "scheduler" in cfg else None
        self.in_background = bool(trainer.get("async_checkpoint"))
        self.committing: Optional[threading.Thread] = None  # rank 0's commit in flight
        self.commit_failed: Optional[tuple[Exception, Path]] = None
        self.writing: list = []  # this rank's sharded writes in flight (FSDP): torch.distributed.checkpoint futures
        self.sharded_groups: list = []  # their process groups, one per state saved, made at the first such save
        self.stagers: list = []  # and the stagers copying each state's shards to host memory in the background
        self.staging: list = []  # futures of the copies in flight: the next optimizer step waits for them

    @classmethod
    def for_run(cls, run, model: torch.nn.Module, ema, progress: Callable[[str], None],
                position: Optional[StreamPosition] = None) -> "Checkpointer":
        """`run`: src/run.py's Run; `model` and `ema` as prepared; `progress`: the hang watch's `alive`; `position`:
        the training loader's, where it keeps one."""
        return cls(run.accelerator, run.run_dir, run.cfg, model, ema, run.data.codec, run.data_fingerprint,
                   run.checkpoint, run.data_changed, progress, position, run.objective.rank_state)

    # ---------------------------------------------------------------------------------------------- loading

    def load(self, state: TrainState) -> None:
        """A resume restores weights, optimizer, schedule, scaler, the EMA, every rank's random streams and the
        data position into `state`; a fresh run seeds each rank's own stream. Every rank calls it."""
        if self.resume_from is None:  # the model was initialised alike on every rank; from here each draws its own
            seed_this_ranks_stream(self.seed, state.step, self.accelerator.process_index)
            return
        load_checkpoint(self.accelerator, self.resume_from, state, self.seed, self.ema,
                        restart_epoch=self.data_changed,
                        new_global_batch=self.cfg.trainer.get("resume_with_new_global_batch", False),
                        stream=self.position is not None and self.position.kept)
        if self.accelerator.is_main_process:  # resumed from an earlier step of this run dir: what came after, aside
            set_aside_later_checkpoints(self.resume_from, self.run_dir)
        if self.position is not None:
            self.position.load(self.resume_from, state, self.data_changed)

    # ----------------------------------------------------------------------------------------------- saving

    def step_finished(self, state: TrainState, metrics: Optional[dict[str, float]] = None,
                      stopping: bool = False) -> None:
        """Every rank calls this after every optimizer step, with the step's evaluation metrics if any, and
        whether the run stops after this step."""
        if metrics is not None and self._improved(metrics, state):
            # The export first: a kill between the two then resumes from an earlier checkpoint, whose best is
            # older, so this step improves again and exports again. The other way round, a checkpoint that
            # already records this step as the best would never redo an export the kill cut short.
            self.export(self.run_dir / "model_best")
            self.save(state, blocking=False)
        if self.saves_at(state.step) or stopping:
            self.save(state, blocking=stopping or state.step >= self.max_steps)
        if state.step == self.decay_from:
            log.info("step %d: the LR schedule's decay starts; checkpoint %s is kept: resume from it with a greater "
                     "trainer.max_steps to train longer (docs/checkpoints.md)", state.step,
                     self.root / step_dir_name(state.step))

    def saves_at(self, step: int) -> bool:
        """Whether step `step` saves whatever happens (periodic, final); besides, an evaluation may save the
        best, and an agreed stop saves."""
        return bool(self.every and step % self.every == 0) or step >= self.max_steps or step == self.decay_from

    def export_final(self) -> None:
        """The trained model (and its EMA) as plain files: RUN/model, RUN/model_ema. Every rank calls it."""
        self.wait()
        started = time.perf_counter()
        with resident_peak() as memory:  # after the summary, which read the run's own peak
            self.export(self.run_dir / "model")
        seconds = time.perf_counter() - started
        peaks = gather_object([memory.get("peak_gib")])  # every rank's, in rank order
        log.info("exported the final model to %s", self.run_dir / "model")
        if self.accelerator.is_main_process:
            record_export(self.run_dir, seconds, peaks)
        if self.ema is not None:
            self.export(self.run_dir / "model_ema", self.ema.module)
            log.info("exported the EMA of the weights to %s", self.run_dir / "model_ema")

    def export(self, directory: Path, module: Optional[torch.nn.Module] = None) -> None:
        self.progress(f"exporting {directory.name}/")
        export_model(self.accelerator, module if module is not None else self.model, self.cfg.model, directory,
                     self.codec)

    def _improved(self, metrics: dict[str, float], state: TrainState) -> bool:
        """Whether `metrics` beat the best monitored value so far; if so, `state` records it."""
        if self.monitor is None or self.monitor not in metrics:  # an evaluation without it (eval_tasks' steps)
            return False
        value = metrics[self.monitor]
        if not improves(value, state.best_metric, self.mode):  # a NaN or infinite metric is never the best
            return False
        state.best_metric, state.best_step = value, state.step
        return True

    def wait(self) -> None:
        """Until the commit in flight is done; if it failed, every rank stops here with its cause. Every rank
        calls it (the verdict is agreed)."""
        if self.committing is not None:
            self.committing.join()
            self.committing = None
        self._wait_for_staging()
        for write in self.writing:
            try:
                write.result()
            except Exception as error:  # noqa: BLE001 (agreed on below, as a failed commit is)
                self.commit_failed = self.commit_failed or (error, self.root / ".tmp-sharded")
        self.writing = []
        failure, tmp = self.commit_failed or (None, None)
        if self.in_background:
            self._stop_if_any_rank_failed(failure, tmp or self.root / ".tmp-unknown")

    def save(self, state: TrainState, blocking: bool = True) -> Path:
        """Every rank must call this (each writes its random state, and its shards under FSDP). `blocking=False`,
        with trainer.async_checkpoint: returns once every rank's files are written, committing in the background."""
        started = time.perf_counter()
        self.wait()
        accelerator, final = self.accelerator, self.root / step_dir_name(state.step)
        if self._on_disk(final):  # e.g. the best checkpoint and the periodic one fall on the same step
            return final
        tmp = self.root / f".tmp-{final.name}"
        if accelerator.is_main_process:
            for stale in self.root.glob(".tmp-*"):  # left by a run killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        self.progress(f"saving checkpoint {final.name}")
        in_background = self.in_background and not blocking
        main, failure, write = accelerator.is_main_process, None, None
        try:
            if sharded(accelerator):  # every rank its shards; in the background, copied now and written by threads
                save_sharded(accelerator, tmp, self._save_in_background if in_background else None,
                             self.without_frozen)
                self._save_rank_state(tmp, state)
                if main:
                    self._save_our_state(tmp, state)
                    writing = self.writing
                    write = (lambda: [w.result() for w in writing]) if in_background else None
            elif in_background:  # copied to host memory now, written by rank 0's thread
                write = self._snapshot(tmp, state)
            else:
                self._save_rank_state(tmp, state)
                if main:
                    write_main_states(main_states(accelerator, without_frozen=self.without_frozen), tmp)
                    self._save_our_state(tmp, state)
        except Exception as error:  # a full or unwritable disk shows as OSError, RuntimeError or a library's own
            failure = error
        self._stop_if_any_rank_failed(failure, tmp)
        accelerator.wait_for_everyone()  # every rank's files (or its RNG state) in tmp before the commit
        self.progress(f"committing checkpoint {final.name} (fsync, rename)")
        if accelerator.is_main_process:
            best_step = state.best_step  # rotation keeps it: as it is now, not as the loop moves on
            if in_background:
                self.committing = threading.Thread(target=self._commit_in_background,
                                                   args=(tmp, final, best_step, started, write),
                                                   name=f"commit-{final.name}")
                self.committing.start()
            else:
                self._commit(tmp, final, best_step, started)
        if not in_background:
            accelerator.wait_for_everyone()
        accelerator.log({"checkpoint/blocking_s": time.perf_counter() - started}, step=state.step)
        return final

    def _on_disk(self, checkpoint: Path) -> bool:
        """Whether rank 0 sees `checkpoint`: every rank acts on its answer (on a network filesystem a rank's own
        look could disagree, and ranks that skip a save while others write it hang)."""
        seen = checkpoint.exists()
        if self.accelerator.num_processes == 1:
            return seen
        from accelerate.utils import broadcast_object_list

        return bool(broadcast_object_list([seen])[0])

    def _save_in_background(self, state_dict: dict, storage_writer) -> None:
        """torch.distributed.checkpoint.save's place under FSDP with trainer.async_checkpoint: async_save, each
        call on a process group of its own, so that its threads' collectives interleave neither with the loop's nor
        with the other state's (the weights and the optimizer state write at once). Each is staged (its shards
        copied to host memory) and written by threads of its own while the loop goes on: the next forward and
        backward only read the shards, and the next optimizer step, the first to change them, waits for the copies
        (a step pre-hook, as torchtitan waits for its staging). The writes' futures are kept until wait()."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if not self.sharded_groups:  # the first such save
            self._each_step_waits_for_the_copies()
        index = len(self.writing)  # every rank saves the same states in the same order
        if len(self.sharded_groups) == index:
            self.sharded_groups.append(dist.new_group(backend="gloo"))
            on_gpu = torch.cuda.is_available()  # pinned host memory and non-blocking copies only from a GPU
            self.stagers.append(DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False,
                                                             use_async_staging=True, use_non_blocking_copy=on_gpu)))
        response = dcp.async_save(state_dict, storage_writer=storage_writer, process_group=self.sharded_groups[index],
                                  async_stager=self.stagers[index])
        self.staging.append(response.staging_completion)
        self.writing.append(response.upload_completion)

    def _each_step_waits_for_the_copies(self) -> None:
        for optimizer in self.accelerator._optimizers:  # accelerate keeps no public list of them
            optimizer.optimizer.register_step_pre_hook(lambda *_: self._wait_for_staging())

    def _wait_for_staging(self) -> None:
        """Until every shard of the saves in flight is copied to host memory (a failed copy is reported by the
        write that follows it, in wait())."""
        for copied in self.staging:
            with contextlib.suppress(Exception):
                copied.result()
        self.staging = []

    def _snapshot(self, tmp: Path, state: TrainState) -> Optional[Callable[[], None]]:
        """A save without FSDP, taken now: each rank writes its random state at once (it is small); rank 0 copies
        the weights, optimizer, schedule and scaler states to host memory and returns the writing of them, for its
        thread. Our own state is written now."""
        self._save_rank_state(tmp, state)
        if not self.accelerator.is_main_process:
            return None
        states = main_states(self.accelerator, on_host=True, without_frozen=self.without_frozen)
        self._save_our_state(tmp, state)
        return lambda: write_main_states(states, tmp)

    def _commit(self, tmp: Path, final: Path, best_step: Optional[int], started: float,
                write: Optional[Callable[[], None]] = None) -> None:
        """Rank 0: the snapshot's files (in the background), every file on disk, then the rename that makes it a
        checkpoint, then rotation."""
        if write is not None:
            write()
        # What a resume compares each file against (safetensors keeps no checksum); the shards' CRCs, every rank's,
        # came with their write results (src/checkpointing/plain_state.py).
        write_checksums(tmp, sorted(folder for folder in tmp.iterdir() if folder.is_dir()))
        _fsync_tree(tmp)
        tmp.rename(final)  # the commit point: atomic on POSIX filesystems
        size_mb = _tree_size(final) / 2**20
        log.info("saved checkpoint %s (%.1f MB) in %.2f s%s", final, size_mb, time.perf_counter() - started,
                 ", written in the background" if write is not None else "")
        self._rotate(best_step)

    def _commit_in_background(self, tmp: Path, *commit) -> None:
        try:
            self._commit(tmp, *commit)
        except Exception as error:  # the next save (or the end) stops every rank with it
            self.commit_failed = (error, tmp)

    def _save_rank_state(self, directory: Path, state: TrainState) -> None:
        """Every rank's own: its random streams, where its stream loader stands, what its objective keeps."""
        save_random_states(self.accelerator, directory)
        kept = self.objective_state()
        if kept:
            save_tree(kept, directory / objective_state_file(self.accelerator.process_index))
        if self.position is not None:
            self.position.save(directory, state)

    def _save_our_state(self, directory: Path, state: TrainState) -> None:
        """Ours beside the training's state: the position, the config, the data's fingerprint, the EMA (JSON, YAML
        and safetensors)."""
        (directory / STATE_FILE).write_text(json.dumps(state.state_dict(), indent=2))
        OmegaConf.save(self.cfg, directory / CONFIG_FILE, resolve=True)
        (directory / DATA_FILE).write_text(json.dumps(self.data_fingerprint, indent=2))
        if self.base is not None:
            (directory / BASE_FILE).write_text(json.dumps(self.base, indent=2))
        if self.ema is not None:  # its tied weights stored once, as for the model
            save_model(self.ema, str(directory / EMA_FILE), metadata={"format": "pt"})

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
            else "at least the size of the model's weights and optimizer state (no earlier one to measure)"
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

    def _rotate(self, best_step: Optional[int]) -> None:
        """Delete the oldest complete checkpoints beyond keep_last; the best one and the decay's start stay apart."""
        keep = {step_dir_name(step) for step in (best_step, self.decay_from) if step is not None}
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

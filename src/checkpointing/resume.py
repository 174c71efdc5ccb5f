"""Which checkpoint a run resumes from, and with which config: the saved one, with only the overrides
that are safe to change on a resume.
"""

import copy
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from src.checkpointing.layout import (
    CONFIG_FILE,
    DATA_FILE,
    RUN_CONFIG,
    STEP_DIR,
    complete_checkpoints,
    newest_checkpoint_before,
)
from src.checkpointing.plain_state import load_tree
from src.checkpointing.training_state import SCHEDULER_FILE
from src.data.base import IDS_MADE_BY, described_ids
from src.errors import UsageError
from src.schema.build import build
from src.schema.data_sizes import resolved_but_data_sizes
from src.schema.keys import flatten
from src.schema.signature import complete, schema_of
from src.schema.trainer import TrainerConfig
from src.schema.trusted import check_targets, trusted_by

log = logging.getLogger(__name__)


# Keys a resumed run may change: they do not alter what is being trained, only how long and how it reports.
SAFE_ON_RESUME = {
    "resume", "trainer.max_steps", "trainer.max_epochs", "trainer.log_every", "trainer.eval_every",
    "trainer.checkpoint_every", "trainer.async_checkpoint",
    "trainer.keep_last_checkpoints", "trainer.dist_timeout_s", "trainer.cpu_threads",
    # The same batches in the same order, read by other processes or threads, or further ahead (a stream, whose
    # order its workers set, refuses another number of them through its fingerprint).
    "data.num_workers", "data.prefetch_factor", "data.read_ahead",
    "trainer.eval_on_start",
    "trainer.trackers", "trainer.tracker_project", "trainer.resume_with_changed_data",
    "trainer.resume_with_new_global_batch",
    # Sampling reads the weights with its own random state: it changes nothing trained (tests/test_sampling.py).
    "trainer.sample_every", "trainer.sample_prompts", "trainer.sample_tokens", "trainer.sample_temperature",
    "trainer.sample_top_k",
    # Steps whose batches are dropped (src/loop/skip_steps.py): new ones only after the checkpoint's step.
    "trainer.skip_steps",
}


DATA_SIZE_PLACEHOLDER = "${dataset:"
LENGTH = "${trainer.max_steps}"  # a schedule's total_steps that follows the run's length


# How the global batch is split may change (e.g. a requeued job given fewer GPUs): load_checkpoint checks
# that the global batch itself does not.
LAYOUT_ON_RESUME = {"data.batch_size", "trainer.gradient_accumulation_steps"}


# null in a config means "the launcher decides"; a checkpoint records the value that was in effect.
LAUNCHER_SETTABLE = {"trainer.mixed_precision", "trainer.gradient_accumulation_steps"}
# null means "the newest": the run records the commit it started from (src/models/hub.py), which a resume keeps.
DECIDED_BY_THE_RUN = {"model.revision", "data.tokenizer_revision", "objective.teacher_revision"}


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


def set_aside_later_checkpoints(checkpoint: Path, run_dir: Path) -> list[Path]:
    """Rank 0, once a resume has loaded: checkpoints of this run dir past the one resumed (resume=PATH to an earlier
    step: a rewind past a loss spike, a corrupted newest one) are another timeline. Left in place, a step that
    exists would not be saved again and a later resume=auto would continue them, so they move, whole, to
    checkpoints/superseded_<time>/, outside what resume=auto and rotation look at."""
    if checkpoint.parent.resolve() != (run_dir / "checkpoints").resolve():
        return []
    resumed = int(STEP_DIR.fullmatch(checkpoint.name).group(1))
    later = [p for p in complete_checkpoints(run_dir) if int(STEP_DIR.fullmatch(p.name).group(1)) > resumed]
    if not later:
        return []
    aside = run_dir / "checkpoints" / time.strftime("superseded_%Y%m%d-%H%M%S")
    aside.mkdir()
    for old in later:
        old.rename(aside / old.name)
    log.warning("resume: from %s, an earlier checkpoint than this run dir's newest: %s moved to %s (not resumed "
                "from, not rotated; delete them when no longer wanted)", checkpoint.name,
                ", ".join(p.name for p in later), aside)
    return later


def config_for_resume(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """The checkpoint's config, plus the command line's safe overrides; any other change is refused.

    Only what the command line names is compared (a key and everything under it; a name the config does
    not have, such as experiment=..., can change anything, so then everything), so re-running the same
    command (e.g. a requeued SLURM job) resumes, while YAML defaults edited since do not leak in.
    """
    saved = OmegaConf.load(checkpoint / CONFIG_FILE)
    # Data until proven ours: a target this command line does not compose is refused before anything imports it.
    check_targets(saved, f"checkpoint {checkpoint / CONFIG_FILE}", trusted_by(cfg))
    trainer, _ = complete(saved.trainer, schema_of(TrainerConfig), "trainer.")
    for key in sorted(trainer.keys() - saved.trainer.keys()):
        # A loop setting added since the checkpoint was written: the checkpoint ran with what is now its default.
        OmegaConf.update(saved, f"trainer.{key}", trainer[key], force_add=True)
        log.info("resume: trainer.%s=%s, its default (a setting newer than the checkpoint)", key, trainer[key])
    new_leaves, old_leaves = _leaves(cfg), _leaves(saved)
    # As typed: Hydra keeps them in a ListConfig, which would resolve a ${dataset:...} inside an override's value.
    as_typed = OmegaConf.to_container(overrides, resolve=False) if OmegaConf.is_config(overrides) else overrides
    named = [override.split("=", 1)[0].lstrip("+~") for override in as_typed]
    scopes = [key if any(_under(leaf, key) for leaf in new_leaves) else "" for key in named]
    refused, changed, new_schedule = [], [], False
    changing_data = bool(new_leaves.get("trainer.resume_with_changed_data"))
    same_samples = _per_process_samples(new_leaves) == _per_process_samples(old_leaves)
    if old_leaves.get("trainer.auto_micro_batch") and same_samples:
        # The checkpoint's micro-batch and accumulation were chosen to fit; the configured product stands.
        new_leaves.update({key: old_leaves[key] for key in ("data.batch_size", "trainer.gradient_accumulation_steps")})
    for leaf in sorted(new_leaves.keys() | old_leaves.keys()):
        new, old = new_leaves.get(leaf), old_leaves.get(leaf)
        # Another data option (trainer.resume_with_changed_data): its keys replace the checkpoint's, null ones too.
        other_keys = changing_data and _under(leaf, "data") and (leaf in new_leaves) != (leaf in old_leaves)
        if isinstance(new, str) and new.startswith(DATA_SIZE_PLACEHOLDER):
            continue  # derived from the data; the checkpoint's model has the value it was built with
        if (new is None or new == "auto") and leaf in LAUNCHER_SETTABLE:
            continue  # the checkpoint's value stands; launch_settings then checks the launcher against it
        if new is None and leaf in DECIDED_BY_THE_RUN and not other_keys:
            continue  # the checkpoint's value stands
        if (new == old and not other_keys) or not any(_under(leaf, scope) for scope in scopes):
            continue
        if leaf == "trainer.skip_steps":
            check_new_skip_steps(old, new, checkpoint)
        if leaf in SAFE_ON_RESUME | LAYOUT_ON_RESUME:
            OmegaConf.update(saved, leaf, new, force_add=True)
            shown = "trainer.max_epochs x the steps of an epoch" if leaf == "trainer.max_steps" and new is None else new
            if leaf != "resume":  # the resume itself is logged where it loads
                changed.append(f"{leaf}: {old} -> {shown}")
        elif _under(leaf, "scheduler"):
            new_schedule = True  # taken as composed; schedule_for_resume checks it once the run's length is known
        elif _under(leaf, "data") and changing_data:
            # Other data (an annealing mixture): check_same_data then checks its ids and restarts its position.
            _set_or_drop(saved, leaf, new, new_leaves)
            changed.append(f"{leaf}: {old if leaf in old_leaves else '(none)'} -> "
                           f"{new if leaf in new_leaves else '(none)'}")
        else:
            refused.append(f"{leaf}={new} (the checkpoint has {old})")
    if refused:
        raise UsageError(
            f"Cannot resume from {checkpoint} with a different model or setup:\n  " + "\n  ".join(refused)
            + f"\nOnly these may change on resume: {', '.join(sorted(SAFE_ON_RESUME | LAYOUT_ON_RESUME))} "
            f"({' and '.join(sorted(LAYOUT_ON_RESUME))} only while the global batch stays the same, unless "
            "trainer.resume_with_new_global_batch=true), and "
            "scheduler.* while the steps taken keep their learning rates, and data.* with "
            "trainer.resume_with_changed_data=true (the data position then restarts at an epoch boundary). "
            "Start a new run (another hydra.run.dir) to change anything else."
        )
    if "trainer.max_steps" in named and saved.trainer.get("max_epochs") is not None and cfg.trainer.max_steps:
        saved.trainer.max_epochs = None  # a length in steps replaces the checkpoint's length in epochs
        changed.append(f"trainer.max_epochs: {old_leaves['trainer.max_epochs']} -> None")
    for line in changed:
        log.warning("resume: override accepted: %s", line)
    composed = OmegaConf.to_container(cfg, resolve=False).get("scheduler")
    length_changed = any(line.startswith(("trainer.max_steps", "trainer.max_epochs")) for line in changed)
    if new_schedule:
        saved.scheduler = composed  # its ${trainer.max_steps} now resolves to the resumed run's length
    elif length_changed and OmegaConf.select(saved, "scheduler.total_steps") is not None and \
            (composed or {}).get("total_steps") == LENGTH:
        saved.scheduler.total_steps = LENGTH  # the schedule follows the new length where it can: schedule_for_resume
    return saved


def check_new_skip_steps(old: Optional[list], new: Optional[list], checkpoint: Path) -> None:
    """A range of trainer.skip_steps added on resume must start after the checkpoint's step: the steps up to it are
    trained already, and skipping them now would skip nothing. The message names the checkpoint to rewind to."""
    step = int(STEP_DIR.fullmatch(checkpoint.name).group(1))
    kept = {tuple(pair) for pair in old or []}
    trained = [tuple(pair) for pair in new or [] if tuple(pair) not in kept and pair[0] <= step]
    if not trained:
        return
    first = min(start for start, _ in trained)
    before = newest_checkpoint_before(checkpoint.parent.parent, first)
    rewind = (f"resume from a checkpoint before step {first}, e.g. resume={before[0]}" if before else
              f"no checkpoint of {checkpoint.parent.parent} is before step {first}: start a new run from the data's "
              "start, or from trainer.init_weights")
    raise UsageError(
        f"Cannot resume from {checkpoint} with trainer.skip_steps {', '.join(f'[{a}, {b}]' for a, b in trained)}: "
        f"that checkpoint has trained steps 1-{step} already, so those steps' batches cannot be dropped now. To "
        f"pass over them, {rewind}."
    )


def _set_or_drop(cfg: DictConfig, leaf: str, value, new_leaves: dict) -> None:
    """Set a full key, or, where the new config has none (another data option's keys), remove it with the
    outermost node of it that the new config lacks."""
    if leaf in new_leaves:
        OmegaConf.update(cfg, leaf, value, force_add=True)
        return
    parts = leaf.split(".")
    depth = next(i for i in range(1, len(parts) + 1)
                 if not any(_under(key, ".".join(parts[:i])) for key in new_leaves))
    node = OmegaConf.select(cfg, ".".join(parts[:depth - 1]))
    if node is not None and parts[depth - 1] in node:
        del node[parts[depth - 1]]


def _per_process_samples(leaves: dict) -> Optional[int]:
    batch, accumulation = leaves.get("data.batch_size"), leaves.get("trainer.gradient_accumulation_steps") or 1
    return batch * accumulation if isinstance(batch, int) else None


def _leaves(cfg: DictConfig) -> dict:
    """full.key -> value of every leaf (lists count as one value), resolved, enums as names."""
    return flatten(resolved_but_data_sizes(cfg, enum_to_str=True))


def _under(leaf: str, scope: str) -> bool:
    return scope == "" or leaf == scope or leaf.startswith(scope + ".")


def check_same_data(checkpoint: Path, fingerprint: dict, accept_changed: bool) -> bool:
    """Whether the data differs from what the checkpoint was trained on; refused unless accepted, since its
    position (epoch, samples into it) would otherwise be continued in data it does not describe."""
    file = checkpoint / DATA_FILE
    if not file.is_file():
        log.warning("resume: %s records no fingerprint of its data: not checked", checkpoint)
        return False
    saved = json.loads(file.read_text())
    if not any(key.startswith("file ") for key in saved):  # saved by a version that did not record files
        fingerprint = {key: value for key, value in fingerprint.items() if not key.startswith("file ")}
    if IDS_MADE_BY not in saved:  # nor its codec's identity
        fingerprint = {key: value for key, value in fingerprint.items() if key != IDS_MADE_BY}
    elif saved[IDS_MADE_BY] != fingerprint.get(IDS_MADE_BY):  # no flag makes other ids mean the checkpoint's tokens
        there, here = saved[IDS_MADE_BY], fingerprint.get(IDS_MADE_BY, "(no text)")
        raise UsageError(
            f"Cannot resume from {checkpoint} on this data: its ids are made by {described_ids(here)}, but the "
            f"checkpoint's model was trained on ids made by {described_ids(there)}, so each id would mean another "
            "token. Tokenize the data as that run did (data.tokenizer, data.level; for data=shards, "
            "scripts/prepare_data.py --tokenizer)."
        )
    changed = [f"{key}: {saved.get(key, '(none)')!r} -> {fingerprint.get(key, '(none)')!r}"
               for key in sorted(saved.keys() | fingerprint.keys()) if saved.get(key) != fingerprint.get(key)]
    if not changed:
        return False
    if not accept_changed:
        raise UsageError(
            f"Cannot resume from {checkpoint}: the data is not what it was trained on:\n  " + "\n  ".join(changed)
            + "\nResume with the data it was trained on, or, if the change is intended, pass "
            "trainer.resume_with_changed_data=true (the data position then restarts at an epoch boundary)."
        )
    log.warning("resume: the data differs from the checkpoint's (%s); trainer.resume_with_changed_data=true: "
                "continuing from an epoch boundary", "; ".join(changed))
    return True


def schedule_for_resume(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """The resumed run's LR schedule, once its length is known: a new one (new keys, or a length that follows a new
    trainer.max_steps) when the steps already taken keep their rates under it, so that the run trains what a run
    with that schedule from the start trains (a WSD in its stable phase, a warm-up's steps); otherwise the
    checkpoint's, when only the length would have followed, and a refusal naming the first changed rate when the
    command line asked for another schedule."""
    # The file config_for_resume read and checked (its CRC, and its targets against this command line's).
    old = OmegaConf.load(checkpoint / CONFIG_FILE).get("scheduler")
    if old is None or old == cfg.scheduler:
        return cfg
    differences = [f"scheduler.{key}: {old.get(key)} -> {cfg.scheduler.get(key)}"
                   for key in sorted(old.keys() | cfg.scheduler.keys()) if old.get(key) != cfg.scheduler.get(key)]
    taken = _schedule_position(checkpoint)
    change = first_changed_rate(old, cfg.scheduler, taken)
    if change is None:
        log.warning("resume: the LR schedule changes (%s): the %d steps taken keep their rates",
                    "; ".join(differences), taken)
        return cfg
    step, before, after = change
    named = {name.split("=", 1)[0].lstrip("+~") for name in overrides}
    if any(not line.startswith("scheduler.total_steps:") for line in differences) or "scheduler.total_steps" in named:
        raise UsageError(
            f"Cannot resume from {checkpoint} with this LR schedule ({'; '.join(differences)}): the rate at step "
            f"{step} (train/lr), which its {taken} steps have already set, would change from {before:.6g} to "
            f"{after:.6g} x optimizer.lr. A schedule may change on resume only where the steps taken keep their "
            "rates (a WSD schedule, scheduler=wsd, before its decay starts). Start a new run (another "
            "hydra.run.dir) for another schedule."
        )
    # Stretched now, its rate would jump (a cosine past its end back up): it keeps the length it was built with.
    log.warning("resume: the LR schedule keeps the length it was built with (scheduler.total_steps=%s): at the new "
                "length the rate at step %d, which the %d steps taken have already set, would change from %.6g to "
                "%.6g x optimizer.lr", old.total_steps, step, taken, before, after)
    cfg = copy.deepcopy(cfg)
    cfg.scheduler = old
    return cfg


def first_changed_rate(old: DictConfig, new: DictConfig, taken: int) -> Optional[tuple[int, float, float]]:
    """(position, old multiplier, new multiplier) of the first of positions 0..taken (the steps taken, and the
    rate the checkpoint's optimizer already holds for the next) where the two schedules differ; None if none does."""
    schedules = []
    for node in (old, new):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        schedules.append(build(node, optimizer, group="scheduler"))
        optimizer.step()  # no gradient, nothing moves: torch then takes the schedule's steps as in order
    for position in range(taken + 1):
        rates = [schedule.get_last_lr()[0] for schedule in schedules]
        if rates[0] != rates[1]:
            return position, rates[0], rates[1]
        for schedule in schedules:
            schedule.step()
    return None


def _schedule_position(checkpoint: Path) -> int:
    """Steps the checkpoint's schedule has taken (fewer than its optimizer steps where non-finite ones were skipped)."""
    file = checkpoint / SCHEDULER_FILE
    if file.is_file():
        return int(load_tree(file)["last_epoch"])
    return int(STEP_DIR.fullmatch(checkpoint.name).group(1))

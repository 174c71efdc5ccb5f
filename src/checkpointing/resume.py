"""Which checkpoint a run resumes from, and with which config: the saved one, with only the overrides
that are safe to change on a resume.
"""

import json
import logging
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from src.checkpointing.layout import CONFIG_FILE, DATA_FILE, RUN_CONFIG, STEP_DIR, complete_checkpoints
from src.errors import UsageError
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
    # Sampling reads the weights with its own random state: it changes nothing trained (tests/test_sampling.py).
    "trainer.sample_every", "trainer.sample_prompts", "trainer.sample_tokens", "trainer.sample_temperature",
    "trainer.sample_top_k",
}


DATA_SIZE_PLACEHOLDER = "${dataset:"


# How the global batch is split may change (e.g. a requeued job given fewer GPUs): load_checkpoint checks
# that the global batch itself does not.
LAYOUT_ON_RESUME = {"data.batch_size", "trainer.gradient_accumulation_steps"}


# null in a config means "the launcher decides"; a checkpoint records the value that was in effect.
LAUNCHER_SETTABLE = {"trainer.mixed_precision", "trainer.gradient_accumulation_steps"}
# null means "the newest": the run records the commit it started from (src/models/hub.py), which a resume keeps.
DECIDED_BY_THE_RUN = {"model.revision", "data.tokenizer_revision"}


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
    refused, changed = [], []
    same_samples = _per_process_samples(new_leaves) == _per_process_samples(old_leaves)
    if old_leaves.get("trainer.auto_micro_batch") and same_samples:
        # The checkpoint's micro-batch and accumulation were chosen to fit; the configured product stands.
        new_leaves.update({key: old_leaves[key] for key in ("data.batch_size", "trainer.gradient_accumulation_steps")})
    for leaf in sorted(new_leaves.keys() | old_leaves.keys()):
        new, old = new_leaves.get(leaf), old_leaves.get(leaf)
        if isinstance(new, str) and new.startswith(DATA_SIZE_PLACEHOLDER):
            continue  # derived from the data; the checkpoint's model has the value it was built with
        if (new is None or new == "auto") and leaf in LAUNCHER_SETTABLE:
            continue  # the checkpoint's value stands; launch_settings then checks the launcher against it
        if new is None and leaf in DECIDED_BY_THE_RUN:
            continue  # the checkpoint's value stands
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
    total_steps = OmegaConf.select(saved, "scheduler.total_steps")
    length_changed = any(line.startswith(("trainer.max_steps", "trainer.max_epochs")) for line in changed)
    if total_steps is not None and length_changed:
        # The saved config is resolved, so the schedule's length is the one the run started with: stretched now,
        # its learning rate would jump back up mid-run.
        log.warning("resume: the LR schedule keeps the length it was built with (scheduler.total_steps=%s): "
                    "it is not stretched to the new length", total_steps)
    return saved


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

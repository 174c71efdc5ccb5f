"""Checkpoints that never lose a run. No file of one is a pickle: safetensors, JSON and YAML only.

Layout of a run directory:
    checkpoints/step_00000500/    complete checkpoints only (written elsewhere, then renamed into place)
        model.safetensors, optimizer.safetensors, scheduler.json, [scaler.json], random_states_<rank>.safetensors
                                  (src/checkpointing/training_state.py; every rank writes its own random state;
                                  under FSDP pytorch_model_fsdp_0/ and optimizer_0/ hold a file per rank)
        data_position_<rank>.json a stream's place in it, as each rank's loader keeps it (src/loop/stream_position.py)
        objective_state_<rank>.safetensors  what the objective keeps (GRPO's completions of num_iterations > 1)
        checksums.json            a CRC-32 of each file rank 0 wrote, compared before a resume reads anything
        ema.safetensors           trainer.ema_decay: the average of the weights
        train_state.json          step, epoch, position in the epoch, best metric
        run_config.yaml           the resolved config the run was started with
        data.json                 the data's fingerprint: a resume on other data is refused
    checkpoints/.tmp-step_.../    a save in progress; never resumed from, removed by the next save

Why not accelerate's own rotation: `ProjectConfiguration(total_limit=K)` deletes old folders before the
new one is written and nothing is atomic, so a kill during a save can leave no loadable checkpoint.
"""

import re
from pathlib import Path
from typing import Optional

STEP_DIR = re.compile(r"step_(\d+)")


STATE_FILE = "train_state.json"


CONFIG_FILE = "run_config.yaml"
DATA_FILE = "data.json"  # the fingerprint of the data trained on (DataModule.fingerprint)
EMA_FILE = "ema.safetensors"  # trainer.ema_decay's AveragedModel


RUN_CONFIG = "config.yaml"  # what train.py writes at the top of the run dir


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (a step_N name exists only once its contents do)."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.fullmatch(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


def newest_checkpoint_before(run_dir: Path, step: int) -> Optional[tuple[Path, int]]:
    """The newest complete checkpoint of a run saved before optimizer step `step`, and its step (None: none is):
    where a rewind past that step starts."""
    steps = [(path, int(STEP_DIR.fullmatch(path.name).group(1))) for path in complete_checkpoints(run_dir)]
    before = [found for found in steps if found[1] < step]
    return before[-1] if before else None

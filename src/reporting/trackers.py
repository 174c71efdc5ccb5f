"""trainer.trackers: where a run's scalars go, through accelerate's own tracker integrations.

TensorBoard is the default and what the template's own tools read. MLflow and Weights & Biases are built as
accelerate tracker objects here, so that their experiment (trainer.tracker_project) and run name (the run
directory's name) are ours, and a resumed run continues the same MLflow / W&B run: the run's id is kept in
the run directory. They log only from the main process (accelerate's trackers do). Where they store runs is
their own setting: MLFLOW_TRACKING_URI (e.g. sqlite:///mlflow.db, offline), WANDB_MODE=offline, ...
"""

import importlib.util
import logging
from pathlib import Path

from accelerate import Accelerator
from accelerate.tracking import MLflowTracker, WandBTracker

from src.errors import UsageError

log = logging.getLogger(__name__)

RUN_ID_FILE = {"mlflow": "mlflow_run_id", "wandb": "wandb_run_id"}
PACKAGE = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def trackers_for(names: list[str], project: str, run_dir: Path) -> list:
    """What Accelerator(log_with=...) takes: names, or tracker objects built with our names and ids."""
    missing = [name for name in names if importlib.util.find_spec(PACKAGE[name]) is None]
    if missing:
        raise UsageError(f"trainer.trackers={list(names)}: {', '.join(missing)} is not installed "
                         f"(pip install {' '.join(PACKAGE[m] for m in missing)}; MLflow: pip install -r "
                         "requirements-extras.txt)")
    out = []
    for name in names:
        saved = run_dir / RUN_ID_FILE[name] if name in RUN_ID_FILE else None
        run_id = saved.read_text().strip() if saved is not None and saved.is_file() else None
        if name == "mlflow":
            out.append(MLflowTracker(experiment_name=project, run_name=run_dir.name, run_id=run_id))
        elif name == "wandb":
            out.append(WandBTracker(project, name=run_dir.name, dir=str(run_dir), id=run_id, resume="allow"))
        else:
            out.append(name)
    return out


def remember_run_ids(accelerator: Accelerator, names: list[str], run_dir: Path) -> None:
    """Main process, after init_trackers: the ids a resumed run needs to continue the same tracker runs."""
    if not accelerator.is_main_process:
        return
    for name in names:
        if name == "mlflow":
            run_id = accelerator.get_tracker("mlflow").active_run.info.run_id
        elif name == "wandb":
            run_id = accelerator.get_tracker("wandb").run.id
        else:
            continue
        (run_dir / RUN_ID_FILE[name]).write_text(run_id + "\n")
        log.info("%s run %s (its id is kept in %s for resume)", name, run_id, run_dir / RUN_ID_FILE[name])

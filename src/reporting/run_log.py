"""What a run leaves for people to read: train.log, config.yaml, TensorBoard scalars. Main process only."""

import logging
import time
from pathlib import Path

from accelerate import Accelerator
from omegaconf import DictConfig, OmegaConf

from src.reporting.trackers import remember_run_ids
from src.schema.keys import flatten

log = logging.getLogger("train")
RUN_LOG_HANDLER = "run-log"


def stop_run_log() -> None:
    """Close train.log: the next job of an in-process sweep (`train.py -m`) logs to its own run dir."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == RUN_LOG_HANDLER]:
        root.removeHandler(handler)
        handler.close()


def open_after_the_last_event_file(directory: Path) -> None:
    """Waits, if need be, until the second after the one in which the newest event file there was opened.

    TensorBoard reads a log dir's event files in the order of their names, events.out.tfevents.<second opened>.
    <host>.<pid>...: two launches that open theirs within one second are ordered by their pids as text ("10234"
    before "9876"), and a resumed launch's purge_step would then drop the steps that the launch after it logged
    (seen: a run killed and resumed within a second, its curves missing 62 steps). A launch opened in a later
    second than every file there sorts after them all. Only a restart within a second of the last one waits."""
    seconds = [int(file.name.split(".")[3]) for file in directory.rglob("events.out.tfevents.*")
               if file.name.split(".")[3].isdigit()]
    if seconds:
        time.sleep(max(0.0, max(seconds) + 1 - time.time()))


def start_run_log(accelerator: Accelerator, cfg: DictConfig, run_dir: Path, banner: str, first_step: int = 0) -> None:
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.set_name(RUN_LOG_HANDLER)
        logging.getLogger().addHandler(handler)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        log.info("\n%s", banner)
    if accelerator.is_main_process and "tensorboard" in cfg.trainer.trackers:
        open_after_the_last_event_file(run_dir / "tensorboard")
    # purge_step: after a resume TensorBoard drops the events a killed run wrote past the checkpoint, so its
    # curves have no duplicated steps; also on a fresh start (resume=auto before any checkpoint was complete).
    accelerator.init_trackers("tensorboard", init_kwargs={"tensorboard": {"purge_step": first_step + 1}})
    remember_run_ids(accelerator, list(cfg.trainer.trackers), run_dir)
    # TensorBoard gets the YAML as text below; the others, params, once: a resumed run continues the
    # tracker's run, whose params are fixed (MLflow refuses to change one, e.g. an extended max_steps).
    with_params = [t for t in accelerator.trackers if t.name != "tensorboard"] if first_step == 0 else []
    if with_params:
        params = flatten(OmegaConf.to_container(cfg, resolve=True))
        for tracker in with_params:
            tracker.store_init_configuration(params)
    if accelerator.is_main_process and "tensorboard" in cfg.trainer.trackers:
        tracker = accelerator.get_tracker("tensorboard", unwrap=True)
        tracker.add_text("config", "```\n" + OmegaConf.to_yaml(cfg, resolve=True) + "\n```", global_step=first_step)

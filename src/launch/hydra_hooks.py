"""What runs inside Hydra before `train.py`'s main: the config check that must come before the run
directory exists, and the one timestamp every rank and node names that directory with.
"""

import functools
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from torch.distributed import TCPStore

from src.errors import UsageError, told_to_the_launcher
from src.faults.run_dir_lock import release_run_dirs
from src.launch.settings import launch_settings
from src.launch.slurm_sweep import check_submitit_slurm
from src.launcher import launched_rank
from src.schema.complete import base_config, complete_config


class ValidateConfig(Callback):
    """Stops on a configuration or launch mistake before Hydra creates the run directory (on_run_start
    precedes it), so a bad value never leaves an empty run dir behind. A mistake found later, while
    building (a missing data file), removes the run dir this launch created if nothing was written to it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._exit_on_errors(config, config.hydra.run.dir)
        self.run_dir = Path(config.hydra.run.dir)
        self.run_dir_existed = self.run_dir.exists()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        release_run_dirs()  # before the empty-dir check below; a SystemExit skips this: see run_then_release
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
        warnings = []
        try:
            with told_to_the_launcher():
                check_run_dir_can_be_made(run_dir)
                if multirun:
                    check_submitit_slurm(config.hydra)
                launch_settings(complete_config(config, warnings).trainer)
            for warning in warnings if launched_rank() == 0 else []:  # every rank checks; one says so
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


# On import: config/train.yaml starts from train_base, and its run dir names ${shared_timestamp:}.
ConfigStore.instance().store(name="train_base", node=base_config())
OmegaConf.register_new_resolver("shared_timestamp", shared_timestamp, use_cache=True, replace=True)

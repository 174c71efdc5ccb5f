"""Every error of ours, in one place. Each means "something the user can change is wrong" (input, launch,
the run's numbers, a lost rank): printed as its message alone, exit status 1; under a multi-process launcher,
also the root cause in its closing table of failed ranks. A leaf: it imports nothing of ours."""

import contextlib
import json
import os
import time
from pathlib import Path

from hydra.errors import CompactHydraException


class UsageError(CompactHydraException):
    """A mistake of the user's, not a bug: Hydra prints it as its message alone (no traceback), exit status 1."""


class ConfigError(UsageError):
    """Everything wrong with a configuration, one line per problem, each naming its full key."""

    def __init__(self, problems: list[str]):
        super().__init__("Invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems


class LaunchError(UsageError):
    """A launch that cannot work: process counts, GPUs per node, ports, run dirs that differ between ranks."""


class RunDirInUse(UsageError):
    """Another live run holds the run directory (src/faults/run_dir_lock.py)."""


class NonFiniteStep(UsageError):
    """A non-finite loss or gradient stopped the run (src/faults/nonfinite.py): the cause is the run's numbers,
    and the message says what to do."""


class DistributedFailure(CompactHydraException):
    """The run ended because another rank did: printed as its message alone (Hydra), exit status 1."""


@contextlib.contextmanager
def told_to_the_launcher():
    """Under torchrun or `accelerate launch`, the launcher's last words are a table of the failed ranks whose
    root cause reads "To enable traceback see: https://pytorch.org/..." unless the worker wrote the file the
    launcher named for it (TORCHELASTIC_ERROR_FILE, in the launcher's temporary folder, not the run's). A run
    that stops on an exception writes it there: our message (a usage error, a non-finite step, a lost rank), or
    a bug's type and message (its traceback is printed above the table)."""
    try:
        yield
    except Exception as error:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            message = (str(error) if isinstance(error, CompactHydraException) else
                       f"{type(error).__name__}: {error} (its traceback is above)")
            with contextlib.suppress(OSError):  # the message is printed anyway: the table is where else it shows
                Path(error_file).parent.mkdir(parents=True, exist_ok=True)
                # Whole or not at all: a rank stopped by the launcher halfway through a plain write left an empty
                # file, which the launcher's JSON reader then failed on (seen once, in place of its table).
                written = Path(f"{error_file}.{os.getpid()}.tmp")
                written.write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
                os.replace(written, error_file)
        raise

"""startup: seconds from starting a command to its first optimizer step (`python train.py` and `accelerate launch
train.py`), against importing torch and accelerate alone (and building an AdamW, which any PyTorch script pays).

Every side is a fresh process timed by the same wall clock of this process, from start to the first step's
TensorBoard event (its wall time) and to exit; repeated, medians compared. Also where the imports' time goes.
"""

import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import run, scalars


def startup(args) -> dict:
    """Seconds from starting a command to its first optimizer step, against importing torch and accelerate."""

    def wall(cmd: list[str]) -> float:
        started = time.time()
        run(cmd)
        return time.time() - started

    def first_step(launcher: list[str]) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.time()
            run([*launcher, "train.py", "trainer.max_steps=1", "trainer.log_every=1", *args.overrides,
                 f"hydra.run.dir={tmp}/r"], env={**os.environ, "TQDM_DISABLE": "1"})
            whole = time.time() - started
            return scalars(Path(tmp) / "r", "train/loss")[0].wall_time - started, whole

    # Any PyTorch training script also pays torch's lazy import of torch._dynamo when it builds an optimizer.
    optimizer = "import torch, accelerate; torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())"
    runs = {"import torch, accelerate": [], "... and build an AdamW": [], "python train.py: first step": [],
            "python train.py: whole": [], "accelerate launch train.py: first step": [],
            "accelerate launch train.py: whole": []}
    for _ in range(args.repeats):
        runs["import torch, accelerate"].append(wall([sys.executable, "-c", "import torch, accelerate"]))
        runs["... and build an AdamW"].append(wall([sys.executable, "-c", optimizer]))
        for name, launcher in (("python train.py", [sys.executable]), ("accelerate launch train.py",
                                                                       ["accelerate", "launch"])):
            first, whole = first_step(launcher)
            runs[f"{name}: first step"].append(first)
            runs[f"{name}: whole"].append(whole)
    base = median(runs["import torch, accelerate"])
    report = {name: {"median_s": round(median(v), 2), "x_import": round(median(v) / base, 2),
                     "runs_s": [round(x, 2) for x in v]} for name, v in runs.items()}
    report["import_profile"] = import_profile()
    return report


def import_profile(top: int = 12) -> list:
    """Where `python train.py`'s imports go: `-X importtime`, cumulative seconds per top-level package."""
    with tempfile.TemporaryDirectory() as tmp:
        out = run([sys.executable, "-X", "importtime", "train.py", "trainer.max_steps=1",
                   f"hydra.run.dir={tmp}/r"], env={**os.environ, "TQDM_DISABLE": "1"}).stderr
    packages: dict[str, float] = {}
    for line in out.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        _, cumulative, name = line.removeprefix("import time:").split("|")
        if not name.startswith("  "):  # one space: an import made at the top level, not inside another one's
            name = name.strip()  # a later, lazy import of a submodule (torch._dynamo) keeps its own name
            packages[name] = packages.get(name, 0.0) + int(cumulative) / 1e6
    return sorted(([name, round(s, 2)] for name, s in packages.items()), key=lambda p: -p[1])[:top]

def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    s = commands.add_parser("startup", help="time to the first optimizer step")
    s.add_argument("overrides", nargs="*")
    return {"startup": startup}

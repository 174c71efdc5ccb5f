"""Run train.py (same arguments) with the host's reads of tensors watched inside every optimizer step.

A step runs from counting its targets (src/loop/accumulation.py: global_target_count) to Telemetry.step_finished:
forward, backward, clipping, the non-finite check, the optimizer and the schedule, the EMA. Logging,
evaluation and checkpoints come after it. Each rank writes {step: [read, ...]} to $HOST_READS_FILE.<rank>
after every step: `.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.cpu()`, `.numpy()` of a tensor, with
the file and line that made it. With HOST_READS_CUDA_SYNC=error (a GPU), torch also raises inside the steps
on any synchronising CUDA call (torch.cuda.set_sync_debug_mode), which sees what Python-level counting cannot.
"""

import collections
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, as for train.py itself
import src.loop.accumulation  # noqa: E402
from src.reporting.telemetry import Telemetry

READS = collections.defaultdict(list)
STEP = {"current": 0, "inside": False}
CUDA_SYNC = os.environ.get("HOST_READS_CUDA_SYNC")


def counted(name: str, original):
    def read(self, *args, **kwargs):
        if STEP["inside"]:
            caller = traceback.extract_stack(limit=2)[0]
            READS[STEP["current"]].append(f"{name} at {caller.filename}:{caller.lineno}")
        return original(self, *args, **kwargs)

    return read


for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"):
    setattr(torch.Tensor, method, counted(method, getattr(torch.Tensor, method)))

global_target_count = src.loop.accumulation.global_target_count


def step_started(*args, **kwargs):
    STEP["current"] += 1
    STEP["inside"] = STEP["current"] > 1  # the first step checks the batch's form, once
    count = global_target_count(*args, **kwargs)
    if CUDA_SYNC and STEP["inside"]:
        torch.cuda.set_sync_debug_mode(CUDA_SYNC)
    return count


step_finished = Telemetry.step_finished


def step_ended(self, counted_targets):
    step_finished(self, counted_targets)
    if CUDA_SYNC:
        torch.cuda.set_sync_debug_mode(0)
    STEP["inside"] = False
    with open(f"{os.environ['HOST_READS_FILE']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump({step: READS.get(step, []) for step in range(2, STEP["current"] + 1)}, f)


src.loop.accumulation.global_target_count = step_started  # src/loop/step.py imports it by name, after this
Telemetry.step_finished = step_ended
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")

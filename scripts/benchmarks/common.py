"""What every benchmark shares: running commands, composing the template's config, taking turns, reading a
run's scalars, peak memory. Each benchmark is a module beside this one (scripts/benchmark.py lists them)."""

import resource
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "scripts" / "benchmark.py"  # the entry point, also of the benchmarks' worker processes
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A benchmark step that must succeed: on failure, its own error output, not only an exit code."""
    done = subprocess.run(cmd, cwd=kwargs.pop("cwd", ROOT), capture_output=True, text=True, **kwargs)
    if done.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import src.launch.hydra_hooks  # noqa: F401  (registers train_base, which config/train.yaml starts from)
    from src.schema.complete import complete_config

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base="1.3"):
        return complete_config(compose(config_name="train", overrides=overrides))


def in_turn(repeat: int, *sides) -> None:
    """Run each side once, in order on even repeats and in reverse on odd ones: no side always gets the machine
    as the other left it (warmer caches, a calmer neighbour)."""
    for side in sides if repeat % 2 == 0 else reversed(sides):
        side()


def scalars(run_dir: Path, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)



def peak_memory_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory_over_ranks_gib(device) -> float:
    """The largest peak of all ranks (every rank calls it): what the template's summary reports as its peak."""
    import torch
    import torch.distributed as dist

    peak = torch.tensor(peak_memory_gib(device), device=device, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def one_document_shards(folder: Path, files: dict[str, list[tuple[str, int]]], vocab_size: int, tokenizer: str,
                        digest: str) -> Path:
    """Finish a prepared folder (scripts/prepare_data.py's layout) whose token files the caller wrote, each one
    document: its index, the byte codec, the manifest. `files`: per split, (file name, tokens) in order."""
    import json

    import numpy as np

    from src.data.shards import FORMAT, MANIFEST
    from src.data.tokenizer import Codec

    for split in files.values():
        for name, tokens in split:
            np.array([tokens], dtype=np.uint64).tofile(folder / (name + ".index"))
    Codec("byte").save(folder)
    splits = {split: [{"file": name, "tokens": tokens, "documents": 1, "digest": digest} for name, tokens in shards]
              for split, shards in files.items()}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "dtype": "uint16", "vocab_size": vocab_size,
                                               "tokenizer": tokenizer, "loss_masks": False, "splits": splits}))
    return folder


def trainer_step_times() -> tuple:
    """(a transformers TrainerCallback, the list of seconds it appends each step's time to): how TRL's side of a
    benchmark is timed, per optimizer step."""
    import time

    from transformers import TrainerCallback

    times, started = [], []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            started.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - started[-1])

    return StepTimes(), times

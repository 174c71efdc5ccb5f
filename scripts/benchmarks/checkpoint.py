"""checkpoint: the template's atomic save (src/checkpointing/training_state.py's safetensors and JSON, our
metadata, a checksum and an fsync of every file, the rename, rotation) against writing the same bytes to the same
disk with open/write/fsync; and how long the loop waits for a save with trainer.async_checkpoint (the commit in
the background), against the blocking save.

Both sides write the same files (the raw side copies the bytes of the template's first save), each after an
os.sync so neither pays for the other's write-back, alternating which goes first; medians of the save times.
"""

import os
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import ROOT, compose_config


def checkpoint(args) -> dict:
    """The template's atomic save (safetensors and JSON, metadata, checksums, fsync, rename) of a model and its AdamW
    state, against writing the same bytes to the same disk with open/write/fsync."""
    import torch
    from accelerate import Accelerator

    from src.checkpointing.checkpointer import Checkpointer
    from src.checkpointing.layout import step_dir_name
    from src.loop.train_state import TrainState
    from src.optim.optimizers import build_optimizer
    from src.run import with_values
    from src.schema.build import build
    from src.schema.data_sizes import resolve_data_sizes

    cfg = compose_config([f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", "model.n_head=8"])
    accelerator = Accelerator(cpu=True)
    data = build(cfg.data, group="data")
    cfg = resolve_data_sizes(cfg, data.sizes())
    model = build(cfg.model, group="model")
    optimizer = build_optimizer(cfg.optimizer, model, global_batch=32)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # so the optimizer has its moments to save
    model, optimizer = accelerator.prepare(model, optimizer)
    times = {"template": [], "raw": [], "template_async_blocking": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        checkpointer = Checkpointer(accelerator, Path(tmp), cfg, model, data_fingerprint=data.fingerprint())
        in_background = Checkpointer(accelerator, Path(tmp) / "async",
                                     with_values(cfg, {"trainer.async_checkpoint": True}), model,
                                     data_fingerprint=data.fingerprint())
        first = checkpointer.save(TrainState(step=0))  # a warm-up, and the bytes the raw side writes
        files = {f.relative_to(first): f.read_bytes() for f in first.rglob("*") if f.is_file()}

        def template_save(step: int) -> None:
            checkpointer.save(TrainState(step=step))

        def raw_write(step: int) -> None:
            target = Path(tmp) / f"raw-{step}"
            for name, content in files.items():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                with open(target / name, "wb") as f:
                    f.write(content)
                    f.flush()
                    os.fsync(f.fileno())

        def async_save(step: int) -> None:  # what the loop waits for; the commit is waited for untimed, below
            in_background.save(TrainState(step=step), blocking=False)

        for step in range(1, args.repeats + 1):
            sides = [("template", template_save), ("raw", raw_write), ("template_async_blocking", async_save)]
            for side, write in sides if step % 2 else sides[::-1]:  # alternating which goes first
                os.sync()  # neither side pays for the other's write-back
                started = time.perf_counter()
                write(step)
                times[side].append(time.perf_counter() - started)
                in_background.wait()
            shutil.rmtree(Path(tmp) / f"raw-{step}")
        assert step_dir_name(args.repeats) in os.listdir(Path(tmp) / "checkpoints")
    size = sum(len(b) for b in files.values())
    ours, raw = times["template"], times["raw"]
    mb = size / 2**20
    blocked = times["template_async_blocking"]
    return {"checkpoint_mb": round(mb, 1), "template_mb_per_s": round(mb / median(ours), 1),
            "raw_write_mb_per_s": round(mb / median(raw), 1), "ratio": round(median(raw) / median(ours), 3),
            "template_s_runs": [round(t, 3) for t in ours], "raw_s_runs": [round(t, 3) for t in raw],
            "async_blocking_s_runs": [round(t, 3) for t in blocked],
            "async_blocking_over_blocking_save": round(median(blocked) / median(ours), 3)}

def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    c = commands.add_parser("checkpoint", help="checkpoint save MB/s against a raw write")
    c.add_argument("--n-layer", type=int, default=8)
    c.add_argument("--n-embd", type=int, default=512)
    c.add_argument("--dir", default=str(ROOT / "outputs"), help="where to write (the disk runs write to)")
    return {"checkpoint": checkpoint}

"""schedules: models of several lengths from one WSD run and its decayed branches, against a cosine run per length.

A cosine schedule must know the run's length from the start: a model of each length is a run of its own. A WSD
schedule (scheduler=wsd) holds its peak until its decay, so its checkpoints of that phase resume into a decay of
any later length (docs/checkpoints.md): one run to the longest length, checkpointed where each shorter length's
decay starts, and one short branch per shorter length. Both sides train the nanoGPT recipe
(config/experiment/nanogpt_shakespeare_char.yaml: cosine to 10 % after 100 warm-up steps) on one process, seed by
seed in turns; each model's exported weights are scored by the nanogpt benchmark's full_validation_loss. Reported
per length: the loss of each side (mean over seeds) and the optimizer steps each side trained for all lengths.
"""

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from statistics import mean

from scripts.benchmarks.common import compose_config, in_turn, run
from scripts.benchmarks.nanogpt import full_validation_loss

RECIPE = ["experiment=nanogpt_shakespeare_char", "trainer.eval_every=0", "trainer.monitor=null"]


def schedules(args) -> dict:
    from src.checkpointing.export import load_exported_model
    from src.optim.schedules import decay_start
    from src.schema.build import build

    val = build(compose_config(RECIPE).data, group="data").val
    lengths, longest = sorted(args.lengths), max(args.lengths)
    wsd = ["scheduler=wsd", "scheduler.warmup_steps=100", f"scheduler.decay_fraction={args.decay_fraction}",
           f"scheduler.min_lr_ratio={args.min_lr_ratio}"]
    starts = {length: decay_start(length, args.decay_fraction) for length in lengths}
    report = {"cosine": [], "wsd": []}
    environment = {**os.environ, "TQDM_DISABLE": "1"}
    with tempfile.TemporaryDirectory() as tmp:

        def loss(run_dir: Path) -> float:
            return round(full_validation_loss(load_exported_model(run_dir / "model"), val), 4)

        def cosine(repeat: int, seed: int):
            def train() -> None:
                losses = {}
                for length in lengths:
                    run_dir = Path(tmp) / f"cosine-{repeat}-{length}"
                    run([sys.executable, "train.py", *RECIPE, f"trainer.seed={seed}", f"trainer.max_steps={length}",
                         "trainer.checkpoint_every=0", *args.overrides, f"hydra.run.dir={run_dir}"], env=environment)
                    losses[length] = loss(run_dir)
                report["cosine"].append({"seed": seed, "full_val_loss": losses, "steps": sum(lengths)})
                print(json.dumps({"cosine": report["cosine"][-1]}), file=sys.stderr, flush=True)
            return train

        def wsd_run(repeat: int, seed: int):
            def train() -> None:
                base = [sys.executable, "train.py", *RECIPE, *wsd, f"trainer.seed={seed}", *args.overrides]
                main = Path(tmp) / f"wsd-{repeat}"
                every = math.gcd(*(starts[length] for length in lengths[:-1]))  # a checkpoint at each decay's start
                run([*base, f"trainer.max_steps={longest}", f"trainer.checkpoint_every={every}",
                     f"trainer.keep_last_checkpoints={longest // max(every, 1) + 1}", f"hydra.run.dir={main}"],
                    env=environment)
                losses = {longest: loss(main)}
                for length in lengths[:-1]:  # each shorter length: its decay, from the checkpoint where it starts
                    branch = Path(tmp) / f"wsd-{repeat}-{length}"
                    run([*base, f"trainer.max_steps={length}",
                         f"resume={main / 'checkpoints' / f'step_{starts[length]:08d}'}", f"hydra.run.dir={branch}"],
                        env=environment)
                    losses[length] = loss(branch)
                steps = longest + sum(length - starts[length] for length in lengths[:-1])
                report["wsd"].append({"seed": seed, "full_val_loss": losses, "steps": steps})
                print(json.dumps({"wsd": report["wsd"][-1]}), file=sys.stderr, flush=True)
            return train

        for repeat, seed in enumerate(seed for seed in args.seeds for _ in range(args.repeats)):
            sides = {"cosine": cosine(repeat, seed), "wsd": wsd_run(repeat, seed)}
            in_turn(repeat, *(sides[side] for side in args.sides))
    report = {side: runs for side, runs in report.items() if runs}
    summary = {f"{side}: mean": {"full_val_loss": {length: round(mean(r["full_val_loss"][length] for r in runs), 4)
                                                   for length in lengths},
                                 "steps for every length": runs[0]["steps"]}
               for side, runs in report.items()}
    return {**report, **summary}


def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    s = commands.add_parser("schedules", help="one WSD run and its decays against a cosine run per length")
    s.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339], help="one run of each side per seed")
    s.add_argument("--lengths", type=int, nargs="+", default=[1000, 1500, 2000], help="optimizer steps of each model")
    s.add_argument("--decay-fraction", type=float, default=0.2, help="scheduler.decay_fraction of the WSD side")
    s.add_argument("--min-lr-ratio", type=float, default=0.0, help="scheduler.min_lr_ratio of the WSD side")
    s.add_argument("--sides", nargs="+", default=["cosine", "wsd"], choices=["cosine", "wsd"],
                   help="one side alone: a variant of it (--min-lr-ratio) beside the other's figures of a run before")
    s.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    return {"schedules": schedules}

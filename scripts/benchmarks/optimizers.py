"""optimizers: the same recipe trained with each optimizer option, seed by seed, in turns: what a model reaches
after the same steps and in the same time (optimizer=muon against optimizer=adamw).

The recipe is config/experiment/nanogpt_shakespeare_char.yaml (the one the nanogpt benchmark compares with
nanoGPT), one process; every run's exported weights are scored by the nanogpt benchmark's full_validation_loss
(every non-overlapping window of the validation split). Each variant is one line of overrides (--variants);
ms/step is the median of train/step_time, so the loss at equal time is the loss at equal steps scaled by it.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

from scripts.benchmarks.common import compose_config, in_turn, run, scalars
from scripts.benchmarks.nanogpt import full_validation_loss

VARIANTS = ["optimizer=adamw", "optimizer=muon", "optimizer=muon optimizer.muon_lr=3e-3",
            "optimizer=muon optimizer.adjust_lr=original optimizer.muon_lr=0.02"]


def optimizers(args) -> dict:
    from src.checkpointing.export import load_exported_model
    from src.schema.build import build

    val = build(compose_config(["experiment=nanogpt_shakespeare_char"]).data, group="data").val
    report = {variant: [] for variant in args.variants}
    with tempfile.TemporaryDirectory() as tmp:

        def side(variant: str, repeat: int, seed: int):
            def train() -> None:
                run_dir = Path(tmp) / f"{args.variants.index(variant)}-{repeat}"
                started = time.time()
                run([sys.executable, "train.py", "experiment=nanogpt_shakespeare_char", f"trainer.seed={seed}",
                     f"trainer.max_steps={args.steps}", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                     "trainer.monitor=null", *variant.split(), *args.overrides, f"hydra.run.dir={run_dir}"],
                    env={**os.environ, "TQDM_DISABLE": "1"})
                report[variant].append({
                    "seed": seed, "wall_s": round(time.time() - started, 1),
                    "full_val_loss": round(full_validation_loss(load_exported_model(run_dir / "model"), val), 4),
                    "ms_per_step": round(1e3 * median(e.value for e in scalars(run_dir, "train/step_time")), 1)})
                print(json.dumps({variant: report[variant][-1]}), file=sys.stderr, flush=True)
            return train

        for repeat, seed in enumerate(seed for seed in args.seeds for _ in range(args.repeats)):
            in_turn(repeat, *(side(variant, repeat, seed) for variant in args.variants))
    summary = {f"{variant}: mean": {key: round(mean(r[key] for r in runs), 4)
                                    for key in ("full_val_loss", "ms_per_step", "wall_s")}
               for variant, runs in report.items()}
    return {**report, **summary}


def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    o = commands.add_parser("optimizers", help="optimizer=muon against optimizer=adamw on the nanoGPT recipe")
    o.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339], help="one run of each variant per seed")
    o.add_argument("--steps", type=int, default=2000, help="optimizer steps of every run (the recipe's 2000)")
    o.add_argument("--variants", nargs="+", default=VARIANTS, help="each a space-separated line of overrides")
    o.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    return {"optimizers": optimizers}

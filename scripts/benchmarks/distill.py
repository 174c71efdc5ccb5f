"""distill: a small student distilled from a stronger teacher against the same student trained on the data alone.

nanoGPT's recipe (config/experiment/nanogpt_shakespeare_char.yaml) on one process. The teacher is the recipe's
model trained once, with Muon at Keller Jordan's scaling by default (the `optimizers` benchmark's best: its full
validation loss is about 0.3 below AdamW's). The students are a smaller GPT (--student, layers x width) trained for
the recipe's steps from the same seed: by the data alone (objective=cross_entropy), and by objective=distill at each
--kd-ratios, seed by seed in turns. Reported per variant: the exported student's full validation loss (the nanogpt
benchmark's measure: cross-entropy with the data, whatever the student trained on) and its ms/step, which holds the
teacher's forward pass; and the teacher's own loss.
"""

import json
import os
import sys
import tempfile
from pathlib import Path
from statistics import mean

from scripts.benchmarks.common import compose_config, in_turn, run
from scripts.benchmarks.nanogpt import full_validation_loss

RECIPE = ["experiment=nanogpt_shakespeare_char", "trainer.eval_every=0", "trainer.monitor=null",
          "trainer.checkpoint_every=0"]
TEACHER = ["optimizer=muon", "optimizer.adjust_lr=original", "optimizer.muon_lr=0.02"]


def distill(args) -> dict:
    from src.checkpointing.export import load_exported_model
    from src.schema.build import build

    val = build(compose_config(RECIPE).data, group="data").val
    layers, width = (int(part) for part in args.student.split("x"))
    student = [f"model.n_layer={layers}", f"model.n_embd={width}"]
    environment = {**os.environ, "TQDM_DISABLE": "1"}
    report: dict = {"students": []}
    with tempfile.TemporaryDirectory() as tmp:

        def loss(run_dir: Path) -> float:
            return round(full_validation_loss(load_exported_model(run_dir / "model"), val), 4)

        def train(run_dir: Path, *overrides: str) -> float:
            """ms per optimizer step (the run's training time over its steps, start-up excluded)."""
            run([sys.executable, "train.py", *RECIPE, *overrides, *args.overrides, f"hydra.run.dir={run_dir}"],
                env=environment)
            summary = json.loads((run_dir / "summary.json").read_text())
            return round(1000 * summary["time_s"]["training"] / summary["steps"], 1)

        teacher = Path(tmp) / "teacher"
        train(teacher, *TEACHER, f"trainer.seed={args.seeds[0]}")
        report["teacher"] = {"full_val_loss": loss(teacher), "parameters": "the recipe's model", "trained by": TEACHER}
        print(json.dumps({"teacher": report["teacher"]}), file=sys.stderr, flush=True)

        def variant(repeat: int, seed: int, kd_ratio):
            def side() -> None:
                run_dir = Path(tmp) / f"student-{repeat}-{kd_ratio}"
                objective = [] if kd_ratio is None else [
                    "objective=distill", f"objective.teacher={teacher / 'model'}", f"objective.kd_ratio={kd_ratio}"]
                ms = train(run_dir, *student, *objective, f"trainer.seed={seed}")
                name = "data alone" if kd_ratio is None else f"distill kd_ratio={kd_ratio}"
                report["students"].append({"variant": name, "seed": seed, "full_val_loss": loss(run_dir),
                                           "ms_per_step": ms})
                print(json.dumps(report["students"][-1]), file=sys.stderr, flush=True)
            return side

        for repeat, seed in enumerate(seed for seed in args.seeds for _ in range(args.repeats)):
            in_turn(repeat, *(variant(repeat, seed, ratio) for ratio in [None, *args.kd_ratios]))
    names = list(dict.fromkeys(r["variant"] for r in report["students"]))
    report["mean"] = {name: {key: round(mean(r[key] for r in report["students"] if r["variant"] == name), 4)
                             for key in ("full_val_loss", "ms_per_step")} for name in names}
    return report


def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    d = commands.add_parser("distill", help="a small student distilled from the recipe's model vs the data alone")
    d.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339], help="one run of each variant per seed")
    d.add_argument("--student", default="2x64", help="the student's layers x width (the recipe's model: 4x128)")
    d.add_argument("--kd-ratios", type=float, nargs="+", default=[0.5, 1.0], help="objective.kd_ratio of each "
                   "distilled variant")
    d.add_argument("overrides", nargs="*", help="Hydra overrides for every run (teacher and students)")
    return {"distill": distill}

"""nanogpt: config/experiment/nanogpt_shakespeare_char.yaml against karpathy/nanoGPT's own train.py, the same
recipe (nanoGPT's README CPU flags) on the same text, one process each, seed by seed.

Both sides' saved weights are scored by one function on the same windows: every non-overlapping 64-character
window of the last 10% of the text (the template's validation split, which holds the characters of nanoGPT's
val.bin), after the same number of optimizer steps (nanoGPT's ckpt.pt is written at iteration 2000, before its
2001st update; the template's model/ after its 2000th). Both do the same evaluation work while they train
(nanoGPT estimates its loss on 20 batches of each split at iteration 0 and every 250; the template evaluates 40
validation batches at the same steps), so wall time, start to exit of each side's command, taken in turns,
compares like with like; ms/step is each side's median step time, evaluation excluded.
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

from scripts.benchmarks.common import ROOT, compose_config, in_turn, run, scalars

NANOGPT_RECIPE = [  # nanoGPT's README recipe for a CPU: its flags, with our experiment mirroring them
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
    "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True",
]


SAME_EVALUATION_WORK = ["trainer.eval_batches=40", "trainer.eval_on_start=true"]


def full_validation_loss(model, val) -> float:
    """Mean next-token cross-entropy over every non-overlapping window of the validation split (the template's
    val set), for any model mapping ids to logits: the same measure for both sides."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(val), 64):
            x, y = (torch.stack(parts) for parts in zip(*(val[i] for i in range(first, min(first + 64, len(val))))))
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count


def nanogpt_full_validation(nanogpt: Path, checkpoint: Path, val) -> float:
    import torch

    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model.py

    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count; stdout is the report
        model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    model.eval()
    # nanoGPT's forward returns logits for the last position only unless given targets: ask for all.
    return full_validation_loss(lambda x: model(x, torch.zeros_like(x))[0], val)


def nanogpt(args) -> dict:
    import torch

    from src.checkpointing.export import load_exported_model
    from src.schema.build import build

    nanogpt_dir = Path(args.nanogpt).resolve()
    cfg = compose_config(["experiment=nanogpt_shakespeare_char"])
    val = build(cfg.data, group="data").val
    report = {"template": [], "nanogpt": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "nanoGPT"
        shutil.copytree(nanogpt_dir, work, ignore=shutil.ignore_patterns(".git", "out-*"))
        data_dir = work / "data" / "shakespeare_char"
        shutil.copy(ROOT / "data" / "tinyshakespeare.txt", data_dir / "input.txt")  # no download: same text
        stub = Path(tmp) / "stub"  # prepare.py imports requests only to download input.txt, present here
        stub.mkdir()
        (stub / "requests.py").write_text("")
        run([sys.executable, "prepare.py"], cwd=data_dir, env={**os.environ, "PYTHONPATH": str(stub)})

        def template_run(repeat: int, seed: int) -> None:
            run_dir = Path(tmp) / f"template-{repeat}"
            started = time.time()
            # One process, as nanoGPT runs: the README's `python train.py`, without the launcher's own start-up.
            # nanoGPT's evaluation work, too: 20 batches of each split (here 40 of validation) at step 0 and every
            # 250 steps; evaluating changes nothing trained (tests/test_features.py).
            run([sys.executable, "train.py", "experiment=nanogpt_shakespeare_char", f"trainer.seed={seed}",
                 *SAME_EVALUATION_WORK, *args.overrides, f"hydra.run.dir={run_dir}"],
                env={**os.environ, "TQDM_DISABLE": "1"})
            wall = time.time() - started
            loss = full_validation_loss(load_exported_model(run_dir / "model"), val)
            summary = json.loads((run_dir / "summary.json").read_text())
            report["template"].append({"seed": seed, "wall_s": round(wall, 1), "full_val_loss": round(loss, 4),
                                       "ms_per_step": round(1e3 * median(
                                           e.value for e in scalars(run_dir, "train/step_time")), 1),
                                       "in_run_val_loss": round(summary["final_metrics"]["eval/loss"], 4)})

        def nanogpt_run(repeat: int, seed: int) -> None:
            out = work / f"out-{repeat}"
            started = time.time()
            # nanoGPT has no seed flag: its one torch.manual_seed(1337 + rank) call gets the seed's offset.
            seeded = (f"import runpy, sys, torch; f = torch.manual_seed; torch.manual_seed = lambda s: f(s + {seed - 1337})"
                      "; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')")
            log = run([sys.executable, "-c", seeded, *NANOGPT_RECIPE, f"--out_dir={out}"], cwd=work).stdout
            wall = time.time() - started
            step_ms = [float(line.split("time ")[1].split("ms")[0]) for line in log.splitlines()
                       if line.startswith("iter ") and "time " in line]
            estimate = [line for line in log.splitlines() if line.startswith("step 2000:")]
            report["nanogpt"].append({"seed": seed, "wall_s": round(wall, 1),
                                      "full_val_loss": round(nanogpt_full_validation(work, out / "ckpt.pt", val), 4),
                                      "ms_per_step": round(median(step_ms[1:]), 1),
                                      "its_estimate_at_2000": estimate[0] if estimate else None})

        for repeat, seed in enumerate(seed for seed in args.seeds for _ in range(args.repeats)):
            in_turn(repeat, lambda: template_run(repeat, seed), lambda: nanogpt_run(repeat, seed))
            print(json.dumps({k: v[-1] for k, v in report.items()}), file=sys.stderr, flush=True)
    del torch
    for side in ("template", "nanogpt"):
        report[f"{side}_mean"] = {key: round(mean(r[key] for r in report[side]), 4) for key in ("wall_s", "full_val_loss")}
    report["wall_ratio"] = round(report["template_mean"]["wall_s"] / report["nanogpt_mean"]["wall_s"], 3)
    return report

def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    n = commands.add_parser("nanogpt", help="config/experiment/nanogpt_shakespeare_char.yaml against nanoGPT")
    n.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    n.add_argument("--seeds", type=int, nargs="+", default=[1337], help="one run of each side per seed (x --repeats)")
    n.add_argument("overrides", nargs="*", help="Hydra overrides for the template's side, e.g. data.random_windows=false")
    return {"nanogpt": nanogpt}

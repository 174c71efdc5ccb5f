"""Faults: a non-finite step never reaches a checkpoint or an export; skipped steps are counted and bounded."""

import json
import math

from safetensors.torch import load_file

from tests.conftest import QUIET, TINY_GPT, run, scalars

ARGS = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.checkpoint_every=1", "trainer.monitor=null",
        "scheduler.warmup_steps=2", "trainer.max_steps=8"]
NAN_MODEL = "model._target_=tests.components.NaNOnCalls"


def test_a_huge_learning_rate_stops_every_rank_at_the_first_nonfinite_step_and_saves_nothing_of_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*ARGS, "optimizer.lr=1e30", "trainer.max_grad_norm=0", f"hydra.run.dir={run_dir}"], nproc=2,
               check=False)
    assert proc.returncode != 0
    step = int(proc.stdout.split("step ", 1)[1].split(":")[0]) if "is not finite" in proc.stdout else None
    assert step is not None and "the loss or the gradient norm is not finite" in proc.stdout, proc.stdout[-3000:]
    assert f"{run_dir / 'checkpoints'} is intact" in proc.stdout
    assert 'train.py", line' not in proc.stdout  # the launcher prints its own traceback for a failed worker
    assert not (run_dir / "model").exists() and not (run_dir / "model_best").exists()
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].name.split("_")[1]) == step - 1  # the last good step, and nothing after it
    weights = load_file(saved[-1] / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())


def test_skip_mode_skips_and_counts_nonfinite_steps_without_advancing_the_schedule(tmp_path):
    run_dir = tmp_path / "run"
    run([*ARGS, NAN_MODEL, "+model.nan_calls=[3,4]", "trainer.nonfinite=skip", f"hydra.run.dir={run_dir}"])
    skipped, lr = scalars(run_dir, "train/skipped_steps"), scalars(run_dir, "train/lr")
    assert skipped[2] == 0 and skipped[3] == 1 and skipped[8] == 2
    assert lr[3] == lr[4] == lr[2]  # the schedule stood still while steps were skipped
    assert all(math.isfinite(v) for v in scalars(run_dir, "eval/loss").values())
    assert all(t.isfinite().all() for t in load_file(run_dir / "model" / "model.safetensors").values())


def test_skip_mode_stops_after_too_many_consecutive_skips(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*ARGS, NAN_MODEL, "+model.nan_calls=[3,4,5]", "trainer.nonfinite=skip",
                "trainer.max_consecutive_skips=2", f"hydra.run.dir={run_dir}"], check=False)
    assert proc.returncode != 0
    assert "step 5: the loss or the gradient norm is not finite" in proc.stdout
    assert "after 2 skipped steps in a row (trainer.max_consecutive_skips=2)" in proc.stdout
    assert not (run_dir / "model").exists()


def test_a_nonfinite_evaluation_is_reported_and_never_becomes_the_best_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run([*ARGS, "model._target_=tests.components.NaNWhenEvaluating", "trainer.monitor=eval/loss",
         "trainer.eval_every=4", f"hydra.run.dir={run_dir}"])
    assert all(math.isnan(v) for v in scalars(run_dir, "eval/loss").values())  # reported as such
    assert not (run_dir / "model_best").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["step"] is None and math.isnan(summary["final_metrics"]["eval/loss"])

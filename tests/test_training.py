"""Single-process runs of each example task: they learn, log real TensorBoard scalars and export a usable model."""

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from src.checkpointing.export import load_exported_model
from src.checkpointing.for_eval import load_checkpointed_model, run_config_for
from src.checkpointing.layout import complete_checkpoints
from tests.conftest import QUIET, ROOT, TINY_GPT, banner_row, exported_weights, max_abs_diff, run, scalars


def learned(losses: dict[int, float], margin: float) -> bool:
    steps = sorted(losses)
    first, last = [losses[s] for s in steps[:5]], [losses[s] for s in steps[-5:]]
    return sum(last) / 5 < sum(first) / 5 - margin


def assert_exported_model_matches_final_checkpoint(run_dir, example_input):
    """The exported safetensors rebuild a fresh model (no accelerate) that computes what training ended with."""
    exported = load_exported_model(run_dir / "model")
    final = complete_checkpoints(run_dir)[-1]
    run_cfg = run_config_for(final)
    checkpointed = load_checkpointed_model(final, run_cfg)
    with torch.no_grad():
        assert torch.equal(exported(example_input), checkpointed(example_input))


def exported_kwargs(run_dir):
    """The data-derived sizes the exported config was saved with (resolved, not ${dataset:...})."""
    cfg = OmegaConf.load(run_dir / "model" / "config.yaml")
    return {k: cfg[k] for k in ("vocab_size", "num_classes") if k in cfg}


def test_gpt_on_text_learns_logs_scalars_and_exports_a_reloadable_model(tmp_path):
    run_dir = tmp_path / "run"
    run([*TINY_GPT, *QUIET, "trainer.max_steps=60", "trainer.eval_every=30", "data.batch_size=16",
         "optimizer.lr=3e-3", "scheduler.warmup_steps=5", f"hydra.run.dir={run_dir}"])
    losses = scalars(run_dir, "train/loss")
    assert sorted(losses) == list(range(1, 61))  # one train/loss per optimizer step
    assert learned(losses, margin=0.5)
    for tag in ("train/lr", "train/grad_norm", "eval/loss", "eval/accuracy"):
        assert scalars(run_dir, tag), tag
    assert sorted(scalars(run_dir, "eval/loss")) == [30, 60]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    tokens = torch.randint(0, exported_kwargs(run_dir)["vocab_size"], (2, 32))
    assert_exported_model_matches_final_checkpoint(run_dir, tokens)


def test_gpt_on_pretokenized_uint16_bin_file_learns(tmp_path):
    bin_file = tmp_path / "shakespeare.bin"
    subprocess.run([sys.executable, "scripts/prepare_tokens.py", "data/tinyshakespeare.txt", str(bin_file)],
                   cwd=ROOT, check=True, capture_output=True)
    run_dir = tmp_path / "run"
    run([*TINY_GPT, *QUIET, "data=tokens", f"data.path={bin_file}", "data.vocab_size=256",
         "trainer.max_steps=50", "data.batch_size=16", "optimizer.lr=3e-3", "scheduler.warmup_steps=5",
         f"hydra.run.dir={run_dir}"])
    assert learned(scalars(run_dir, "train/loss"), margin=0.5)


def test_resnet_on_cifar10_binary_files_learns_and_exports_a_reloadable_model(tmp_path, cifar_root):
    run_dir = tmp_path / "run"
    run(["experiment=cifar10_resnet", f"data.root={cifar_root}", "model.width=8", "data.batch_size=32",
         "data.num_workers=0", "trainer.max_steps=40", "scheduler.warmup_steps=5", *QUIET,
         f"hydra.run.dir={run_dir}"])
    losses = scalars(run_dir, "train/loss")
    assert learned(losses, margin=0.3)
    accuracy = scalars(run_dir, "eval/accuracy")
    assert accuracy[40] > 0.3  # 10 classes: chance is 0.1
    assert_exported_model_matches_final_checkpoint(run_dir, torch.randn(4, 3, 32, 32))


def test_bf16_mixed_precision_trains_on_cpu(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*TINY_GPT, *QUIET, "trainer.mixed_precision=bf16", "trainer.max_steps=30", "data.batch_size=16",
                "optimizer.lr=3e-3", "scheduler.warmup_steps=5", f"hydra.run.dir={run_dir}"])
    assert banner_row(proc.stdout, "mixed precision") == "bf16 (config: trainer.mixed_precision)"
    losses = scalars(run_dir, "train/loss")
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert learned(losses, margin=0.3)


def test_evaluating_more_often_trains_the_same_weights_with_dropout(tmp_path):
    """Evaluation draws nothing from training's random streams: how often a run evaluates is not a training
    choice (an evaluation's new loader iterator used to draw its seed from the global RNG, dropout's)."""
    args = [*TINY_GPT, *QUIET, "model.dropout=0.2", "trainer.max_steps=6", "data.batch_size=8"]
    for every in (2, 0):
        run([*args, f"trainer.eval_every={every}", f"hydra.run.dir={tmp_path / str(every)}"])
    assert sorted(scalars(tmp_path / "2", "eval/loss")) == [2, 4, 6]
    assert scalars(tmp_path / "2", "train/loss") == scalars(tmp_path / "0", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "2"), exported_weights(tmp_path / "0")) == 0


def test_eval_entry_point_reproduces_the_final_eval_metric_of_training(tmp_path):
    run_dir = tmp_path / "run"
    run([*TINY_GPT, *QUIET, "trainer.max_steps=20", "data.batch_size=16", "trainer.eval_batches=null",
         f"hydra.run.dir={run_dir}"])  # the whole validation set, as eval.py evaluates it
    logged = scalars(run_dir, "eval/loss")[20]
    for source in (run_dir / "model", complete_checkpoints(run_dir)[-1]):
        run([f"path={source}"], script="eval.py")
        report = json.loads((source / "eval_metrics.json").read_text())
        assert abs(report["eval/loss"] - logged) < 1e-5, (source, report, logged)


@pytest.mark.slow  # compiles twice (tests/test_compiled_step.py proves the compiled step in-process)
def test_a_compiled_ddp_run_learns_what_the_eager_one_does_and_exports_weights_a_fresh_model_loads(tmp_path):
    args = [*TINY_GPT, *QUIET, "trainer.max_steps=6", "data.batch_size=8", "trainer.eval_batches=3"]
    for mode in ("eager", "compiled"):
        proc = run([*args, f"trainer.compile={mode == 'compiled'}", f"hydra.run.dir={tmp_path / mode}"], nproc=2)
    assert banner_row(proc.stdout, "torch.compile") == "the training step (mode default) and evaluation"
    eager, compiled = scalars(tmp_path / "eager", "train/loss"), scalars(tmp_path / "compiled", "train/loss")
    assert eager.keys() == compiled.keys() and all(abs(eager[s] - compiled[s]) < 1e-4 for s in eager)
    assert abs(scalars(tmp_path / "eager", "eval/loss")[6] - scalars(tmp_path / "compiled", "eval/loss")[6]) < 1e-4
    tokens = torch.randint(0, exported_kwargs(tmp_path / "compiled")["vocab_size"], (2, 32))
    assert_exported_model_matches_final_checkpoint(tmp_path / "compiled", tokens)  # no "_orig_mod." in either


def test_a_training_set_without_a_length_trains_to_the_end_and_writes_its_summary(tmp_path):
    """A user's streamed data (an IterableDataset): no epochs to count, so the run ends at trainer.max_steps."""
    run_dir = tmp_path / "run"
    run([*TINY_GPT, *QUIET, "data._target_=tests.components.StreamedText", "data.batch_size=4", "trainer.max_steps=3",
         f"hydra.run.dir={run_dir}"])
    assert sorted(scalars(run_dir, "train/loss")) == [1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3

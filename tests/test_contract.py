"""The open contract: the launcher's settings are honoured, the loss is exact on variable-length data however a
global batch is split, and Hugging Face models and batches work from config alone."""

import json
import sys

import pytest
import torch

from tests.conftest import (
    QUIET,
    ROOT,
    TINY_GPT,
    banner_row,
    exported_weights,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
)

SMALL = [*TINY_GPT, *QUIET, "trainer.max_steps=3", "data.batch_size=4", "trainer.checkpoint_every=0",
         "trainer.monitor=null", "scheduler.warmup_steps=1"]


def accelerate_launch(launcher_args: list[str], overrides: list[str], env: dict | None = None):
    return run(overrides, check=False, env=env, command=[sys.executable, "-m", "accelerate.commands.launch",
                                                         *launcher_args, "--dynamo_backend", "no", "train.py"])


# --- the launcher's settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flag", "config_file"])
def test_launcher_bf16_trains_in_bf16_with_autocast_really_active(tmp_path, how):
    if how == "flag":
        launcher, source = ["--mixed_precision", "bf16"], "launcher: --mixed_precision"
    else:
        config = tmp_path / "accelerate.yaml"
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\n"
                          "mixed_precision: bf16\n")
        launcher, source = ["--config_file", str(config)], f"launcher: config file {config}"
    record = tmp_path / "autocast.json"
    proc = accelerate_launch(launcher, [*SMALL, "model._target_=tests.components.AutocastRecorder",
                                        f"hydra.run.dir={tmp_path / 'run'}"], env={"AUTOCAST_RECORD": str(record)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert banner_row(proc.stdout, "mixed precision") == f"bf16 ({source})"
    assert json.loads(record.read_text()) == {"enabled": True, "dtype": "torch.bfloat16"}


def test_a_config_precision_contradicting_the_launcher_is_refused_naming_both(tmp_path):
    proc = accelerate_launch(["--mixed_precision", "bf16"], [*SMALL, "trainer.mixed_precision=no",
                                                            f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode != 0
    named(proc.stdout, "trainer.mixed_precision=no", "bf16", "--mixed_precision")
    # accelerate's launcher prints its own traceback for any failed child; none of ours may appear.
    assert 'train.py", line' not in proc.stdout and f"{ROOT / 'src'}" not in proc.stdout
    assert not (tmp_path / "run").exists()


def test_launcher_gradient_accumulation_is_honoured_and_shown_with_its_source(tmp_path):
    proc = accelerate_launch(["--gradient_accumulation_steps", "2"], [*SMALL, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert banner_row(proc.stdout, "gradient accumulation steps") == "2 (launcher: --gradient_accumulation_steps)"
    assert banner_row(proc.stdout, "global batch size").startswith("8 ")


def test_a_multi_cpu_config_file_asking_for_two_processes_warns_with_the_command_that_works(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the launcher behaves differently")
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                      "num_machines: 1\nmachine_rank: 0\n")
    proc = accelerate_launch(["--config_file", str(config)], [*SMALL, f"hydra.run.dir={tmp_path / 'run'}"])
    named(proc.stdout, "2 processes", f"config file {config}",
          "accelerate launch --multi_gpu --num_processes 2 train.py")


# --- exact loss normalisation on variable-length data ------------------------------------------------------

JSONL_LAYOUT_ARGS = [*TINY_GPT, *QUIET, "data=jsonl", "objective=causal_lm", "data.tokenizer=byte",
                     "trainer.max_steps=6", "trainer.max_grad_norm=0", "optimizer.lr=1e-2", "scheduler.warmup_steps=2",
                     "trainer.checkpoint_every=0", "trainer.monitor=null"]


def test_variable_length_batches_give_the_same_weights_and_losses_however_the_global_batch_is_split(tmp_path):
    """Global batch 8 of padded documents: token-weighted loss is exact in all four layouts; a mean per
    micro-batch (what this template does not do) measurably differs, so this test can fail."""
    layouts = {"1proc_b8_k1": (1, 8, 1), "1proc_b4_k2": (1, 4, 2), "2proc_b4_k1": (2, 4, 1), "2proc_b2_k2": (2, 2, 2)}
    weights, losses = {}, {}
    for name, (nproc, batch, accumulation) in layouts.items():
        run([*JSONL_LAYOUT_ARGS, f"data.batch_size={batch}", f"trainer.gradient_accumulation_steps={accumulation}",
             f"hydra.run.dir={tmp_path / name}"], nproc=nproc)
        weights[name], losses[name] = exported_weights(tmp_path / name), scalars(tmp_path / name, "train/loss")
    reference = "1proc_b8_k1"
    assert sorted(losses[reference]) == list(range(1, 7))
    for name in layouts:
        assert max_abs_diff(weights[reference], weights[name]) <= 1e-5, name
        assert max(abs(losses[reference][s] - losses[name][s]) for s in losses[reference]) <= 1e-5, name

    run([*JSONL_LAYOUT_ARGS, "data.batch_size=2", "trainer.gradient_accumulation_steps=2",
         "objective._target_=tests.components.MeanPerMicroBatch", f"hydra.run.dir={tmp_path / 'mean'}"], nproc=2)
    assert max_abs_diff(weights[reference], exported_weights(tmp_path / "mean")) > 1e-3


# --- Hugging Face transformers, from config alone -------------------------------------------------------------

HF = ["model=hf_causal_lm", "data=jsonl", "objective=causal_lm", "model.config.n_layer=2", "model.config.n_embd=32",
      "model.config.n_head=2", "model.block_size=48", *QUIET]


@pytest.mark.parametrize("nproc", [1, 2])
def test_hf_causal_lm_on_padded_documents_learns_and_exports_a_folder_from_pretrained_loads(tmp_path, nproc):
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    run([*HF, "trainer.max_steps=40", "data.batch_size=8", "optimizer.lr=3e-3", "scheduler.warmup_steps=5",
         "trainer.eval_every=40", f"hydra.run.dir={run_dir}"], nproc=nproc)
    losses = scalars(run_dir, "train/loss")
    assert sum(losses[s] for s in range(36, 41)) / 5 < sum(losses[s] for s in range(1, 6)) / 5 - 0.5
    samples, tokens = scalars(run_dir, "train/samples_per_second"), scalars(run_dir, "train/tokens_per_second")
    # Throughput counts targets, not padding: a quarter of the speeches are shorter than the 48-token window
    # (42.9 counted targets per sample on average, 47 if padding counted).
    per_sample = sum(tokens[s] / samples[s] for s in samples) / len(samples)
    assert 40 < per_sample < 45.5
    assert scalars(run_dir, "eval/loss")[40] < 5.0  # ln 256 = 5.55: better than uniform over bytes

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    from src.checkpointing.export import load_exported_model

    ours = load_exported_model(run_dir / "model")
    ids = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        assert torch.equal(hf_model(input_ids=ids).logits, ours(input_ids=ids).logits)


def test_labels_equal_to_inputs_under_a_non_shifting_objective_stop_the_run(tmp_path):
    """A dataset that does not declare its Hugging Face convention is still caught, on its first batch."""
    proc = run([*TINY_GPT, *QUIET, "data=jsonl", "data._target_=tests.components.UndeclaredJsonl",
                "trainer.max_steps=2", "data.batch_size=4", f"hydra.run.dir={tmp_path / 'run'}"], check=False)
    refused(proc, "input_ids", "objective=causal_lm")

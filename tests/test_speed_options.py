"""Speed and memory options keep their guarantees: they change how fast or how lean, never what is learned."""

import os
import subprocess
import sys

import pytest
import torch

from src.data.text import TextData, TokenWindows
from src.launch.accelerator import glibc
from tests.conftest import QUIET, ROOT, TINY_GPT, banner_row, exported_weights, max_abs_diff, named, run, scalars

SHORT = [*TINY_GPT, *QUIET, "trainer.max_steps=6", "trainer.checkpoint_every=0", "trainer.monitor=null",
         "optimizer.lr=1e-2", "scheduler.warmup_steps=2"]


def test_activation_checkpointing_gives_the_same_losses_and_weights_with_dropout_on(tmp_path):
    for name, flag in (("plain", "false"), ("checkpointed", "true")):
        run([*SHORT, "model.dropout=0.1", "data.batch_size=8", f"model.gradient_checkpointing={flag}",
             f"hydra.run.dir={tmp_path / name}"])
    assert scalars(tmp_path / "checkpointed", "train/loss") == scalars(tmp_path / "plain", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "plain"), exported_weights(tmp_path / "checkpointed")) <= 1e-6


def test_random_offset_moves_the_windows_each_epoch_and_keeps_their_number():
    tokens = torch.arange(1000).numpy()
    windows = TokenWindows(tokens, block_size=10, random_offset=True, seed=3)
    starts = []
    for epoch in range(4):
        windows.set_epoch(epoch)
        starts.append(int(windows[0][0][0]))
        assert len(windows) == 99 and int(windows[len(windows) - 1][1][-1]) <= 999  # the last window fits
    assert len(set(starts)) > 1 and all(0 <= s < 10 for s in starts)
    windows.set_epoch(2)
    again = int(windows[0][0][0])
    assert again == starts[2]  # a function of (seed, epoch) only: what exact resume needs


def test_random_windows_start_anywhere_independently_and_are_a_function_of_seed_epoch_and_index():
    tokens = torch.arange(1000).numpy()
    windows = TokenWindows(tokens, block_size=10, random_windows=True, seed=3)
    starts = {}
    for epoch in range(3):
        windows.set_epoch(epoch)
        assert len(windows) == 99
        for i in range(len(windows)):
            x, y = windows[i]
            assert len(x) == len(y) == 10 and torch.equal(y, x + 1)  # inside the stream, targets shifted by one
            starts[epoch, i] = int(x[0])
    assert len(set(starts.values())) > 0.4 * len(starts)  # independent starts: few coincide (990 of them)
    assert min(starts.values()) < 50 and max(starts.values()) > 940  # the whole stream is reached
    assert len({starts[e, i] % 10 for e in range(3) for i in range(99)}) == 10  # not a grid
    again = TokenWindows(tokens, block_size=10, random_windows=True, seed=3)
    again.set_epoch(1)
    assert [int(again[i][0][0]) for i in range(99)] == [starts[1, i] for i in range(99)]  # what resume needs
    other = TokenWindows(tokens, block_size=10, random_windows=True, seed=4)
    other.set_epoch(1)
    assert [int(other[i][0][0]) for i in range(99)] != [starts[1, i] for i in range(99)]


def test_fast_character_encoding_gives_the_vocabulary_and_ids_of_the_plain_definition(tmp_path):
    text = "Où est l'été? ∑ 😀 naïve café\nZ" * 20
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    data = TextData(path=str(tmp_path / "t.txt"), block_size=8)
    vocab = sorted(set(text))
    assert data.vocab == vocab and data.vocab_size == len(vocab)
    ids = [vocab.index(ch) for ch in text]
    assert data.train.tokens.tolist() + data.val.tokens.tolist() == ids
    assert data.decode(ids[:12]) == text[:12]


def test_auto_micro_batch_keeps_the_global_batch_and_the_weights_of_the_configured_run_and_resume_reuses_it(tmp_path):
    configured = [*SHORT, "data.batch_size=8", "trainer.checkpoint_every=3"]
    run([*configured, f"hydra.run.dir={tmp_path / 'configured'}"])
    auto = [*configured, "model._target_=tests.components.OutOfMemoryAbove", "+model.max_batch=2",
            "data.eval_batch_size=2", "trainer.auto_micro_batch=true", f"hydra.run.dir={tmp_path / 'auto'}"]
    proc = run(auto)
    named(proc.stdout, "auto micro-batch: 2 samples per process")
    assert banner_row(proc.stdout, "global batch size") == "8 (= 2 per process x 1 processes x 4 micro-steps)"
    assert max_abs_diff(exported_weights(tmp_path / "configured"), exported_weights(tmp_path / "auto")) <= 1e-5

    saved = (tmp_path / "auto" / "config.yaml").read_text()
    assert "\n  batch_size: 2\n" in saved and "gradient_accumulation_steps: 4" in saved
    proc = run([*auto, "trainer.max_steps=9", "resume=auto"])  # the same command, a longer run
    assert "resumed from" in proc.stdout and "samples per process do not fit" not in proc.stdout
    assert sorted(scalars(tmp_path / "auto", "train/loss")) == list(range(1, 10))


@pytest.mark.parametrize("objective", ["grpo", "distill", "dpo", "simpo", "cross_entropy"])
def test_auto_micro_batch_refuses_an_objective_that_runs_more_than_the_model_whose_memory_it_cannot_probe(objective):
    """A reference model, a teacher, completions: built by the objective's start(), after the probe (which once
    crashed on a distillation batch). The objectives of the model's passes alone are probed."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from src.loop.auto_batch import runs_beside_the_model
    from tests.test_config import compose_train

    overrides = {"grpo": ["data=prompts", "objective.seed=0"], "distill": ["objective.teacher=any"]}.get(objective, [])
    config = compose_train([f"objective={objective}", *overrides])
    built = instantiate(OmegaConf.to_container(config.objective, resolve=True))
    assert runs_beside_the_model(built) == (objective in ("grpo", "distill", "dpo"))


def test_auto_micro_batch_with_grpo_is_refused_before_training_naming_what_to_give_instead(tmp_path):
    run_dir = tmp_path / "grpo"
    proc = run([*SHORT, "data=prompts", "objective=grpo", "trainer.auto_micro_batch=true",
                f"hydra.run.dir={run_dir}"], check=False)
    assert proc.returncode != 0
    named(proc.stdout, "trainer.auto_micro_batch", "GRPO", "completions", "data.batch_size",
          "trainer.gradient_accumulation_steps", "trainer.auto_micro_batch=false")
    assert "step 1/" not in proc.stdout and not (run_dir / "checkpoints").exists()


ACTIVATIONS = """
import resource, sys, torch
from src.launch.accelerator import keep_freed_memory
print(keep_freed_memory(torch.device(sys.argv[1])))
def step():  # a step's activations: 40 MiB taken and freed
    activations = [torch.ones(256, 1024) for _ in range(40)]
    del activations
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
@pytest.mark.skipif(not glibc(), reason="glibc's malloc only")
def test_a_cpu_run_reuses_the_memory_of_freed_activations_instead_of_faulting_it_in_every_step():
    users_choice = ("MALLOC_", "LD_PRELOAD", "GLIBC_TUNABLES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(users_choice)}
    faults = {}
    for device in ("cpu", "meta"):  # meta: not a CPU run, glibc's malloc left as it is
        out = subprocess.run([sys.executable, "-c", ACTIVATIONS, device], cwd=ROOT, env=env, text=True,
                             capture_output=True, check=True).stdout.split()
        faults[device] = (out[0], float(out[1]))
    assert faults["cpu"][0] == "True" and faults["meta"][0] == "False"
    assert faults["cpu"][1] < faults["meta"][1] / 4, faults  # measured: ~90 against ~1000 page faults a step
    chosen = subprocess.run([sys.executable, "-c", ACTIVATIONS, "cpu"], cwd=ROOT, text=True, capture_output=True,
                            env={**env, "MALLOC_ARENA_MAX": "2"}, check=True).stdout.split()
    assert chosen[0] == "False"  # the user's own malloc settings win

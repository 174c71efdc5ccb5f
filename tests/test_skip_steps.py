"""trainer.skip_steps: passing over the data of a loss spike. A skipped step reads its batches and trains nothing,
the LR schedule and the data position move on as through a trained step, and a rewind that adds a range trains
what a run that skipped those steps from the start trains, bitwise."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from src.errors import ConfigError
from src.loop.skip_steps import SkipSteps
from src.loop.spikes import SpikeWatch
from src.schema.complete import complete_config
from tests.conftest import (
    QUIET,
    TINY_GPT,
    exported_weights,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
)
from tests.test_config import compose_train

# 1 process accumulating 2 micro-batches per step: a skipped step must read both.
ARGS = [*TINY_GPT, *QUIET, "trainer.max_steps=8", "trainer.gradient_accumulation_steps=2",
        "trainer.checkpoint_every=1", "trainer.keep_last_checkpoints=10"]
SKIP = "trainer.skip_steps=[[4,5]]"


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def trained_through(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("skip") / "through"
    run([*ARGS, f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.fixture(scope="module")
def skipping(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("skip") / "skipping"
    proc = run([*ARGS, SKIP, f"hydra.run.dir={run_dir}"])
    named(proc.stdout, "trainer.skip_steps: steps 4-5", "training again from step 6")
    return run_dir


def test_skipped_steps_train_nothing_and_move_the_data_and_the_schedule_as_trained_ones_do(trained_through,
                                                                                          skipping):
    for file in ("model.safetensors", "optimizer.safetensors"):  # weights and AdamW's moments as before step 4
        before, after = load_file(checkpoint(skipping, 3) / file), load_file(checkpoint(skipping, 5) / file)
        assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before), file
    assert max_abs_diff(load_file(checkpoint(skipping, 3) / "model.safetensors"),
                        load_file(checkpoint(trained_through, 4) / "model.safetensors")) > 0  # step 4 trains, else
    position = [json.loads((checkpoint(run_dir, 5) / "train_state.json").read_text()) for run_dir in
                (trained_through, skipping)]
    assert position[0]["samples_into_epoch"] > 0 and position[0] == position[1]
    assert sorted(scalars(skipping, "train/loss")) == [1, 2, 3, 6, 7, 8]  # nothing logged of a dropped step
    lr_through, lr_skipping = scalars(trained_through, "train/lr"), scalars(skipping, "train/lr")
    assert all(lr_skipping[step] == lr_through[step] for step in (6, 7, 8))
    assert len(set(lr_through.values())) > 3  # the schedule changes from step to step (a warm-up), so it shows


def test_a_rewind_that_adds_a_range_trains_what_a_run_skipping_it_from_the_start_trains(trained_through, skipping,
                                                                                         tmp_path):
    run_dir = tmp_path / "rewound"
    shutil.copytree(trained_through, run_dir)
    proc = run([*ARGS, SKIP, f"resume={checkpoint(run_dir, 3)}", f"hydra.run.dir={run_dir}"])
    named(proc.stdout, "override accepted: trainer.skip_steps", "trainer.skip_steps: steps 4-5")
    assert max_abs_diff(exported_weights(run_dir), exported_weights(skipping)) == 0
    assert max_abs_diff(exported_weights(run_dir), exported_weights(trained_through)) > 0


def test_a_resume_inside_a_range_on_another_process_count_goes_on_skipping(skipping, tmp_path):
    """Resumed after step 4 of 4-5 on 2 processes without accumulation (the same global batch): step 5 is still
    dropped, with no collective that only one side would call."""
    run_dir = tmp_path / "resumed"
    proc = run([*ARGS, "trainer.gradient_accumulation_steps=1", f"resume={checkpoint(skipping, 4)}",
                f"hydra.run.dir={run_dir}"], nproc=2)
    named(proc.stdout, "trainer.skip_steps: steps 5-5")
    assert sorted(scalars(run_dir, "train/loss")) == [6, 7, 8]
    assert max_abs_diff(exported_weights(run_dir), exported_weights(skipping)) <= 1e-5


def test_a_range_added_on_resume_that_the_checkpoint_has_trained_is_refused_naming_one_before_it(
        trained_through, tmp_path):
    run_dir = tmp_path / "late"
    proc = run([*ARGS, "trainer.skip_steps=[[4,6]]", f"resume={checkpoint(trained_through, 5)}",
                f"hydra.run.dir={run_dir}"], check=False)
    refused(proc, "trainer.skip_steps [4, 6]", "trained steps 1-5 already",
            f"resume={checkpoint(trained_through, 3)}")
    assert not (run_dir / "checkpoints").exists()


def test_a_range_is_first_to_last_from_step_1_and_one_past_the_run_is_said_to_skip_nothing():
    for pair in ("[5,3]", "[0,2]"):
        with pytest.raises(ConfigError) as error:
            complete_config(compose_train([f"trainer.skip_steps=[{pair}]"]))
        named(str(error.value), "trainer.skip_steps", "1 <= first <= last")
    with pytest.raises(ConfigError) as error:
        complete_config(compose_train(["trainer.skip_steps=[4,5]"]))  # a pair, not a list of pairs
    named(str(error.value), "trainer.skip_steps")
    warnings = []
    complete_config(compose_train(["trainer.max_steps=10", "trainer.skip_steps=[[11,20]]"]), warnings)
    named("\n".join(warnings), "trainer.skip_steps: [11, 20]", "skips nothing")


def test_overlapping_and_adjacent_ranges_join_and_each_is_announced_once(caplog):
    skip = SkipSteps([[8, 9], [3, 4], [5, 6], [4, 5]])
    assert skip.ranges == [(3, 6), (8, 9)]
    assert [step for step in range(1, 12) if skip.covers(step)] == [3, 4, 5, 6, 8, 9]
    assert [r.getMessage().split(" read")[0] for r in caplog.records] == ["trainer.skip_steps: steps 3-6",
                                                                          "trainer.skip_steps: steps 8-9"]


def watch(tmp_path: Path, saved: tuple[int, ...] = (), factor: float = 3.0) -> SpikeWatch:
    for step in saved:
        checkpoint(tmp_path, step).mkdir(parents=True)
    return SpikeWatch(factor, tmp_path, log_every=10)


def test_a_falling_or_noisy_loss_is_no_spike_and_a_jump_is_reported_once_naming_the_rewind(tmp_path):
    spikes = watch(tmp_path, saved=(100, 200, 300))
    falling = [4.0 * 0.97 ** i * (1.1 if i % 3 else 0.9) for i in range(40)]  # steps 10..400, noisy
    assert not any(spikes.logged(10 * (i + 1), {"train/loss": loss}) for i, loss in enumerate(falling))
    usual = sorted(falling[-20:])[10]
    report = spikes.logged(410, {"train/loss": 3.5 * usual})
    named(report, "spiked at step 410", f"resume={checkpoint(tmp_path, 300)}", "'trainer.skip_steps=[[301,410]]'",
          f"hydra.run.dir={tmp_path}")
    assert spikes.logged(420, {"train/loss": 3.4 * usual}) is None  # the same spike: said once
    assert spikes.logged(430, {"train/loss": usual}) is None
    named(spikes.logged(440, {"train/loss": 5 * usual}), "spiked at step 440")  # back down, then a new one
    assert spikes.logged(450, {}) is None  # a step that logs nothing
    quiet = SpikeWatch(None, tmp_path, log_every=10)
    assert not any(quiet.logged(step, {"train/loss": 100.0 * step}) for step in range(10, 200, 10))


def test_a_loss_around_zero_or_below_has_no_scale_to_spike_on(tmp_path):
    """A policy gradient's loss (objective=grpo) is about 0, either sign: 0 after a median of -1e-8 is no spike."""
    spikes = watch(tmp_path)
    assert not any(spikes.logged(10 * (i + 1), {"train/loss": loss}) for i, loss in
                   enumerate([-1e-8, 2e-9, -3e-8, -1e-9, -2e-8, 0.0, -1e-8, 4e-8, 0.0]))


def test_a_spike_before_any_checkpoint_says_there_is_none_to_rewind_to(tmp_path):
    spikes = watch(tmp_path, saved=(50,))  # saved at step 50, but the spike may have begun at step 41
    for step in range(10, 60, 10):
        spikes.logged(step, {"train/loss": 2.0})
    named(spikes.logged(50, {"train/loss": 7.0}), "No checkpoint before it")


def test_the_rewind_a_launched_run_reports_for_a_spike_is_one_it_accepts(tmp_path):
    """A low factor on a flat, noisy loss (optimizer.lr=1e-9): the first logged loss above the median is reported, and
    the command it names resumes, skipping from the step after that checkpoint."""
    args = [*TINY_GPT, *QUIET, "optimizer.lr=1e-9", "trainer.spike_factor=1.001", "trainer.checkpoint_every=4",
            "trainer.max_steps=16"]
    proc = run([*args, f"hydra.run.dir={tmp_path / 'run'}"])
    report = next(line for line in proc.stdout.splitlines() if "train/loss spiked at step" in line)
    command = report.split("rewind past its data (docs/checkpoints.md, 'Past a loss spike'): ")[1].split()
    resume, skip = command[0], command[1].strip("'")
    assert resume.startswith(f"resume={tmp_path / 'run' / 'checkpoints'}") and skip.startswith("trainer.skip_steps")
    resumed = run([*args, resume, skip, f"hydra.run.dir={tmp_path / 'run'}"])
    named(resumed.stdout, "override accepted: trainer.skip_steps", "read their batches and drop them untrained")


def test_a_long_spike_does_not_raise_the_bar_the_next_one_is_measured_against(tmp_path):
    spikes = watch(tmp_path, saved=(10,))
    for step in range(10, 110, 10):
        spikes.logged(step, {"train/loss": 2.0})
    assert spikes.logged(110, {"train/loss": 7.0}) is not None
    assert not any(spikes.logged(step, {"train/loss": 7.0}) for step in range(120, 300, 10))  # 18 logged, high
    spikes.logged(300, {"train/loss": 2.0})
    assert spikes.logged(310, {"train/loss": 7.0}) is not None

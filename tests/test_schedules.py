"""Learning-rate schedules, and what a resume may change of them: a new length or new keys where the steps
already taken keep their rates (a WSD schedule before its decay), the schedule it was built with otherwise."""

import pytest
import torch
from omegaconf import OmegaConf

from src.checkpointing.resume import first_changed_rate
from src.optim.schedules import decay_start, warmup_stable_decay
from tests.conftest import (
    QUIET,
    TINY_GPT,
    exported_weights,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
    snapshot,
)


def multipliers(total_steps: int, steps: int, **options) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = warmup_stable_decay(optimizer, total_steps=total_steps, **options)
    return [schedule.lr_lambdas[0](step) for step in range(steps)]


def test_wsd_warms_up_holds_the_peak_then_decays_to_its_floor_over_the_runs_last_part():
    rates = multipliers(10, 12, warmup_steps=2, decay_fraction=0.4, min_lr_ratio=0.1)
    assert rates[:2] == [0.5, 1.0] and rates[2:7] == [1.0] * 5  # decay from step 6: the last 4 of 10
    assert rates[6:10] == pytest.approx([1.0, 0.775, 0.55, 0.325]) and rates[10:] == [0.1, 0.1]
    for shape in ("sqrt", "cosine"):
        shaped = multipliers(10, 12, warmup_steps=2, decay_fraction=0.4, decay_shape=shape)
        assert shaped[:7] == rates[:7] and shaped[10:] == [0.0, 0.0]
        assert all(a > b for a, b in zip(shaped[6:11], shaped[7:11]))  # falling throughout
    assert multipliers(10, 12, warmup_steps=2, decay_steps=4, decay_fraction=0.9, min_lr_ratio=0.1) == rates
    assert multipliers(10, 12, warmup_steps=0, decay_fraction=0) == [1.0] * 12  # held, to be decayed later
    assert multipliers(4, 5, warmup_steps=4, decay_fraction=0.5) == [0.25, 0.5, 0.75, 0.5, 0.0]  # the lower of both


def test_wsd_rates_before_its_decay_do_not_depend_on_the_runs_length():
    assert decay_start(1000, 0.2) == 800 and decay_start(100, 0.2) == 80
    assert multipliers(100, 81, warmup_steps=10) == multipliers(1000, 81, warmup_steps=10)
    wsd = OmegaConf.create({"_target_": "src.optim.schedules.warmup_stable_decay", "total_steps": 100,
                            "warmup_steps": 10})
    longer = OmegaConf.merge(wsd, {"total_steps": 1000})
    assert first_changed_rate(wsd, longer, taken=80) is None
    assert first_changed_rate(wsd, longer, taken=81) == (81, pytest.approx(0.95), 1.0)
    cosine = OmegaConf.create({"_target_": "src.optim.schedules.warmup_cosine", "total_steps": 100,
                               "warmup_steps": 10})
    assert first_changed_rate(cosine, OmegaConf.merge(cosine, {"total_steps": 1000}), taken=10) is None  # warming up
    assert first_changed_rate(cosine, OmegaConf.merge(cosine, {"total_steps": 1000}), taken=80)[0] == 11


WSD = [*TINY_GPT, *QUIET, "scheduler=wsd", "scheduler.warmup_steps=2", "scheduler.decay_fraction=0.25"]


def test_a_wsd_run_lengthened_from_where_its_decay_starts_trains_what_the_longer_run_trains_from_the_start(
        tmp_path):
    run([*WSD, "trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'long'}"])
    short = tmp_path / "short"  # its decay: steps 4 to 6; the checkpoint of step 4 outlives rotation
    proc = run([*WSD, "trainer.max_steps=6", "trainer.checkpoint_every=1", "trainer.keep_last_checkpoints=2",
                "trainer.monitor=null", f"hydra.run.dir={short}"])
    assert sorted(p.name for p in (short / "checkpoints").iterdir()) == [f"step_0000000{n}" for n in (4, 5, 6)]
    named(proc.stdout, "step 4: the LR schedule's decay starts", "step_00000004 is kept")
    proc = run([*WSD, "trainer.max_steps=12", f"resume={short / 'checkpoints' / 'step_00000004'}",
                f"hydra.run.dir={tmp_path / 'lengthened'}"])
    named(proc.stdout, "scheduler.total_steps: 6 -> 12", "the 4 steps taken keep their rates")
    assert max_abs_diff(exported_weights(tmp_path / "lengthened"), exported_weights(tmp_path / "long")) == 0
    # Lengthened after its decay began, it keeps its length: the rates of steps taken never change.
    kept = run([*WSD, "trainer.max_steps=12", "resume=auto", f"hydra.run.dir={short}"])
    named(kept.stdout, "keeps the length it was built with (scheduler.total_steps=6)", "step 5")
    lr = scalars(short, "train/lr")
    assert lr[4] == lr[3] > lr[5] > 0 and lr[6] == lr[12] == 0  # after step s, the rate of step s + 1


def test_a_constant_rate_run_is_decayed_from_its_checkpoint_and_a_schedule_that_rewrites_the_past_is_refused(
        tmp_path):
    constant = [*TINY_GPT, *QUIET, "scheduler=constant", "optimizer.lr=1e-3", "trainer.checkpoint_every=3"]
    run([*constant, "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'constant'}"])
    checkpoint = tmp_path / "constant" / "checkpoints" / "step_00000003"
    before = snapshot(tmp_path / "constant")
    cooldown = [*constant, f"resume={checkpoint}", "scheduler=wsd", "scheduler.warmup_steps=0",
                "trainer.max_steps=5", "scheduler.decay_steps=2"]
    proc = run([*cooldown, f"hydra.run.dir={tmp_path / 'decayed'}"])
    named(proc.stdout, "scheduler._target_: src.optim.schedules.constant -> src.optim.schedules.warmup_stable_decay")
    lr = scalars(tmp_path / "decayed", "train/lr")  # after step s: the rate of step s + 1
    assert [lr[step] for step in (4, 5)] == pytest.approx([5e-4, 0.0])
    # Warming up again would change the rates of the steps taken: refused, before anything is written.
    proc = run([*cooldown, "scheduler.warmup_steps=2", f"hydra.run.dir={tmp_path / 'refused'}"], check=False)
    refused(proc, "scheduler.warmup_steps: 0 -> 2", "the rate at step 0", "from 1 to 0.5", "scheduler=wsd")
    assert not (tmp_path / "refused" / "checkpoints").exists() and snapshot(tmp_path / "constant") == before

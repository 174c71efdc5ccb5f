"""The loop's pure logic, in process: what improves, when early stopping stops, the LR schedules, which
samples each optimizer step takes (and takes again after a resume), and which overrides a resume accepts."""

import logging
import math
import threading

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from src.checkpointing.resume import config_for_resume
from src.errors import UsageError
from src.loop.accumulation import accumulation_windows, steps_per_epoch
from src.loop.early_stopping import EarlyStopping
from src.loop.read_ahead import ReadAhead
from src.loop.step import TrainStep
from src.loop.train_state import TrainState, improves
from src.objectives.classification import CrossEntropy
from src.optim.schedules import constant, warmup_cosine
from tests.components import ScaledGradient
from tests.conftest import named


@pytest.mark.parametrize("value, best, mode, min_delta, expected", [
    (1.0, None, "min", 0.0, True),  # anything beats nothing yet
    (0.9, 1.0, "min", 0.0, True),
    (1.0, 1.0, "min", 0.0, False),  # equal is not better
    (0.95, 1.0, "min", 0.05, False),  # by more than min_delta, not by exactly it
    (0.94, 1.0, "min", 0.05, True),
    (1.1, 1.0, "max", 0.0, True),
    (0.9, 1.0, "max", 0.0, False),
    (math.nan, None, "min", 0.0, False),  # a NaN never becomes the best, not even the first
    (-math.inf, 1.0, "min", 0.0, False),
])
def test_improves_means_better_by_more_than_min_delta_and_never_a_non_finite_value(value, best, mode, min_delta,
                                                                                   expected):
    assert improves(value, best, mode, min_delta) is expected


def test_early_stopping_counts_evaluations_without_improvement_and_a_resumed_state_stays_stopped():
    stopper, state = EarlyStopping("eval/loss", "min", patience=2, min_delta=0.0), TrainState()
    assert not stopper.should_stop({"eval/loss": 1.0}, state)
    assert not stopper.should_stop(None, state)  # a step without evaluation counts nothing
    assert not stopper.should_stop({"eval/loss": 1.2}, state) and state.evals_without_improvement == 1
    assert not stopper.should_stop({"eval/loss": 0.8}, state) and state.evals_without_improvement == 0
    assert not stopper.should_stop({"eval/loss": math.nan}, state)
    assert stopper.should_stop({"eval/loss": 0.8}, state)  # the second in a row that does not beat 0.8
    named(stopper.reason(state), "0.8", "2 evaluations")  # the best value, and the patience used up
    resumed = TrainState()
    resumed.load_state_dict(state.state_dict())
    assert stopper.already_stopped(resumed)
    assert not EarlyStopping("eval/loss", "min", None, 0.0).should_stop({"eval/loss": 9.0}, state)  # off


def test_early_stopping_on_a_downstream_score_counts_only_the_evaluations_that_scored_it():
    """trainer.monitor=eval_tasks/...: the validation loss alone (eval_every's steps between the tasks') is not
    an evaluation of the monitored score."""
    stopper, state = EarlyStopping("eval_tasks/cloze/acc", "max", patience=2, min_delta=0.0), TrainState()
    assert not stopper.should_stop({"eval/loss": 1.0, "eval_tasks/cloze/acc": 0.5}, state)
    for _ in range(3):
        assert not stopper.should_stop({"eval/loss": 2.0}, state) and state.evals_without_improvement == 0
    assert not stopper.should_stop({"eval_tasks/cloze/acc": 0.4}, state)
    assert stopper.should_stop({"eval/loss": 0.5, "eval_tasks/cloze/acc": 0.5}, state)


def multipliers(schedule, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    return out


def test_warmup_cosine_rises_linearly_then_decays_to_its_floor_at_total_steps_and_stays_there():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    lrs = multipliers(warmup_cosine(optimizer, total_steps=14, warmup_steps=4, min_lr_ratio=0.1), 20)
    assert lrs[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway down
    assert all(a > b for a, b in zip(lrs[4:14], lrs[5:14]))
    assert lrs[14:] == pytest.approx([0.1] * 6)


def test_constant_schedule_warms_up_then_holds_the_optimizer_lr():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    assert multipliers(constant(optimizer, warmup_steps=2), 4) == pytest.approx([0.25, 0.5, 0.5, 0.5])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    assert multipliers(constant(optimizer), 2) == pytest.approx([0.5, 0.5])


@pytest.fixture(scope="module")
def accelerator():
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    yield accelerator
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


SAMPLES = 40


def step_samples(accelerator, batch_size: int, accumulation: int, state: TrainState, max_steps: int,
                 read_ahead: bool = False, dataset=None, step=lambda: None) -> list:
    """The samples each optimizer step takes, from where `state` is, and the position after each step; `step` runs
    as the training step would, after each window."""
    dataset = list(range(SAMPLES)) if dataset is None else dataset
    loader = accelerator.prepare(DataLoader(dataset, batch_size=batch_size, shuffle=True))
    global_batch = batch_size * accumulation
    epoch_steps = steps_per_epoch(loader.dataset, global_batch, "layout")
    out = []
    for window in accumulation_windows(accelerator, loader, state, max_steps, accumulation, epoch_steps,
                                       read_ahead=read_ahead):
        step()
        state.step += 1
        out.append((sorted(torch.cat(window).tolist()), (state.epoch, state.samples_into_epoch)))
    return out


def test_each_epoch_takes_whole_global_batches_of_one_shuffle_and_the_next_epoch_reshuffles(accelerator):
    steps = step_samples(accelerator, 2, 3, TrainState(), max_steps=12)  # 6 steps of 6 samples per epoch
    epochs = [[s for s, _ in steps[:6]], [s for s, _ in steps[6:]]]
    for epoch in epochs:
        taken = [i for samples in epoch for i in samples]
        assert len(taken) == len(set(taken)) == 36  # the 4 left over wait for a later epoch's shuffle
    assert epochs[0] != epochs[1]
    assert [position for _, position in steps[5:7]] == [(0, 36), (1, 6)]


@pytest.mark.parametrize("stopped_after", [1, 4, 6, 9])
def test_a_run_resumed_from_its_position_takes_the_samples_the_uninterrupted_run_took(accelerator, stopped_after):
    whole = step_samples(accelerator, 2, 3, TrainState(), max_steps=12)
    epoch, samples_into_epoch = whole[stopped_after - 1][1]
    resumed = TrainState(step=stopped_after, epoch=epoch, samples_into_epoch=samples_into_epoch)
    assert step_samples(accelerator, 2, 3, resumed, max_steps=12) == whole[stopped_after:]


def test_another_split_of_the_same_global_batch_takes_the_same_samples_at_every_step(accelerator):
    assert ([s for s, _ in step_samples(accelerator, 3, 2, TrainState(), 12)]
            == [s for s, _ in step_samples(accelerator, 2, 3, TrainState(), 12)])


@pytest.mark.parametrize("stopped_after", [2, 5])
def test_a_new_global_batch_continues_the_epochs_order_from_the_first_sample_not_trained(accelerator,
                                                                                       stopped_after):
    """trainer.resume_with_new_global_batch: 6 samples a step (2 x 3) stopped after 12 or 30, resumed with 10 a step
    (2 x 5): the rest of epoch 0 in its shuffle order, 10 at a time, to whole global batches of the new size; then
    epoch 1 as a run of 10 a step would take it."""
    order = [samples[0] for samples, _ in step_samples(accelerator, 1, 1, TrainState(), max_steps=2 * SAMPLES)]
    taken = 6 * stopped_after
    resumed = step_samples(accelerator, 2, 5, TrainState(step=stopped_after, samples_into_epoch=taken), 20)
    rest = (SAMPLES - taken) // 10
    assert [samples for samples, _ in resumed[:rest]] == [sorted(order[taken + 10 * i: taken + 10 * (i + 1)])
                                                           for i in range(rest)]
    assert [position for _, position in resumed[:rest]] == [(0, taken + 10 * (i + 1)) for i in range(rest)]
    epoch_1 = step_samples(accelerator, 2, 5, TrainState(epoch=1), 4)
    assert resumed[rest:rest + 4] == epoch_1


class ReadBy:
    """Samples 0..SAMPLES-1 that note which thread read each, and draw from torch's global generator if told."""

    def __init__(self, draws: bool = False):
        self.draws, self.threads = draws, []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> int:
        self.threads.append(threading.current_thread().name)
        if self.draws:
            torch.rand(())
        return i


@pytest.mark.parametrize("stopped_after", [0, 4, 9])
def test_reading_ahead_takes_the_same_samples_and_positions_as_reading_in_the_training_thread(accelerator,
                                                                                           stopped_after):
    whole = step_samples(accelerator, 2, 3, TrainState(), max_steps=12)
    state = TrainState()
    if stopped_after:
        epoch, samples_into_epoch = whole[stopped_after - 1][1]
        state = TrainState(step=stopped_after, epoch=epoch, samples_into_epoch=samples_into_epoch)
    dataset = ReadBy()
    assert step_samples(accelerator, 2, 3, state, 12, read_ahead=True, dataset=dataset) == whole[stopped_after:]
    # Each epoch's first window is the training thread's (the loader's start); the rest the reader's.
    assert "read-ahead" in dataset.threads and dataset.threads[0] == threading.main_thread().name


def test_reading_ahead_reads_no_sample_more_than_the_training_thread_would(accelerator):
    in_thread, ahead = ReadBy(), ReadBy()
    step_samples(accelerator, 2, 3, TrainState(), max_steps=6, dataset=in_thread)  # an epoch of 6 steps of 6
    step_samples(accelerator, 2, 3, TrainState(), max_steps=6, read_ahead=True, dataset=ahead)
    assert len(ahead.threads) == len(in_thread.threads) < SAMPLES  # what is left over is not read


def test_a_dataset_drawing_from_the_global_generator_is_read_in_the_training_thread(accelerator, caplog):
    whole = step_samples(accelerator, 2, 3, TrainState(), max_steps=12)
    dataset = ReadBy(draws=True)
    with caplog.at_level(logging.WARNING):
        assert step_samples(accelerator, 2, 3, TrainState(), 12, read_ahead=True, dataset=dataset) == whole
    assert set(dataset.threads) == {threading.main_thread().name}
    named(caplog.text, "data.read_ahead=true", "global random generator", "(seed, epoch, index)")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_training_steps_own_draws_do_not_keep_the_reader_from_starting(accelerator, caplog, accumulation):
    """Dropout on a CPU draws from torch's global generator between the windows: that is the step's, not the
    dataset's, and reading ahead stays on (it did not: the check spanned the first step)."""
    whole = step_samples(accelerator, 2, accumulation, TrainState(), max_steps=12)
    dataset = ReadBy()
    with caplog.at_level(logging.WARNING):
        assert step_samples(accelerator, 2, accumulation, TrainState(), 12, read_ahead=True, dataset=dataset,
                            step=lambda: torch.rand(3)) == whole
    assert "read-ahead" in dataset.threads and "global random generator" not in caplog.text


def test_a_reader_hands_on_the_error_of_the_batch_it_failed_at_and_stops_when_closed():
    def items():
        yield from (0, 1)
        raise RuntimeError("batch 2 is corrupt")

    reader = ReadAhead(items(), count=5, chunk=3, device=torch.device("cpu"))
    assert [next(reader), next(reader)] == [0, 1]  # what it read before the error
    with pytest.raises(RuntimeError, match="batch 2 is corrupt"):
        next(reader)
    reader.close()
    blocked = ReadAhead(iter(range(100)), count=100, chunk=2, device=torch.device("cpu"))
    assert next(blocked) == 0
    blocked.close()  # the reader waits on a full queue: it stops instead
    assert not blocked._thread.is_alive()
    assert list(ReadAhead(iter(range(100)), count=5, chunk=2, device=torch.device("cpu"))) == [0, 1, 2, 3, 4]
    assert list(ReadAhead(iter(range(3)), count=5, chunk=2, device=torch.device("cpu"))) == [0, 1, 2]


def test_a_training_set_smaller_than_one_global_batch_is_refused_with_the_keys_to_change():
    with pytest.raises(UsageError) as refused:
        steps_per_epoch(list(range(40)), 64, "data.batch_size=64 x 1 process(es)")
    named(str(refused.value), "40 samples", "64", "data.batch_size", "trainer.gradient_accumulation_steps")


def saved_run(tmp_path, **trainer):
    cfg = OmegaConf.create({"resume": None, "model": {"_target_": "m.M", "width": 8},
                            "data": {"batch_size": 4, "num_workers": 0},
                            "trainer": {"max_steps": 10, "max_epochs": None, "lr_unused": 1, "log_every": 5,
                                        "mixed_precision": "no", "gradient_accumulation_steps": 1, **trainer}})
    checkpoint = tmp_path / "step_00000010"
    checkpoint.mkdir()
    OmegaConf.save(cfg, checkpoint / "run_config.yaml")
    return cfg, checkpoint


def test_resume_takes_safe_overrides_refuses_others_and_ignores_defaults_edited_since(tmp_path):
    saved, checkpoint = saved_run(tmp_path)
    now = OmegaConf.merge(saved, {"trainer": {"max_steps": 20, "log_every": 1}, "model": {"width": 16}})
    resumed = config_for_resume(now, checkpoint, ["trainer.max_steps=20"])
    assert resumed.trainer.max_steps == 20  # named on the command line and safe: taken
    assert resumed.trainer.log_every == 5 and resumed.model.width == 8  # not named: the checkpoint's values
    with pytest.raises(UsageError, match=r"model.width=16 \(the checkpoint has 8\)"):
        config_for_resume(now, checkpoint, ["model.width=16"])
    with pytest.raises(UsageError, match=r"model.width=16"):  # a name the config lacks may change anything
        config_for_resume(now, checkpoint, ["experiment=bigger"])


def test_how_the_loader_reads_may_change_on_resume_as_it_changes_no_batch(tmp_path):
    saved, checkpoint = saved_run(tmp_path)
    reading = {"num_workers": 2, "prefetch_factor": 4, "read_ahead": True}
    typed = [f"data.{key}={value}" for key, value in reading.items()]
    resumed = config_for_resume(OmegaConf.merge(saved, {"data": reading}), checkpoint, typed)
    assert {key: resumed.data[key] for key in reading} == reading


def test_resume_reads_the_command_line_as_typed_even_where_a_value_names_a_data_size(tmp_path):
    """Hydra hands the overrides over as a ListConfig; ${dataset:vocab_size} is unknown until the data is built."""
    saved, checkpoint = saved_run(tmp_path)
    typed = OmegaConf.create(["trainer.max_steps=20", "+model.head={vocab_size: ${dataset:vocab_size}}"])
    with pytest.raises(UsageError, match=r"model.head"):  # refused as a change, not a resolution error
        config_for_resume(OmegaConf.merge(saved, {"model": {"head": {"vocab_size": 3}}}), checkpoint, typed)


def test_resume_in_steps_replaces_a_length_in_epochs(tmp_path):
    saved, checkpoint = saved_run(tmp_path, max_epochs=3)
    resumed = config_for_resume(OmegaConf.merge(saved, {"trainer": {"max_steps": 50}}), checkpoint,
                                ["trainer.max_steps=50"])
    assert (resumed.trainer.max_steps, resumed.trainer.max_epochs) == (50, None)


def test_a_checkpoint_older_than_a_trainer_setting_resumes_with_its_default_unless_the_command_changes_it(tmp_path):
    saved, checkpoint = saved_run(tmp_path)  # written before trainer.compile_mode (and most settings) existed
    now = OmegaConf.merge(saved, {"trainer": {"compile_mode": "max-autotune-no-cudagraphs"}})  # e.g. a YAML's
    resumed = config_for_resume(now, checkpoint, ["trainer.max_steps=10"])
    assert resumed.trainer.compile_mode == "default" and resumed.trainer.trackers == ["tensorboard"]
    with pytest.raises(UsageError) as refused:
        config_for_resume(now, checkpoint, ["trainer.compile_mode=max-autotune-no-cudagraphs"])
    named(str(refused.value), "trainer.compile_mode=max-autotune-no-cudagraphs", "default")



class OverflowsOnCalls(torch.nn.Linear):
    """A linear classifier whose backward overflows (the loss finite) on the forward calls listed, as fp16's can."""

    def __init__(self, calls: set):
        super().__init__(4, 3)
        self.calls, self.called = calls, 0

    def forward(self, x):
        self.called += 1
        logits = super().forward(x)
        return ScaledGradient.apply(logits, math.inf) if self.called in self.calls else logits


def test_a_step_the_fp16_grad_scaler_skips_inside_a_fused_optimizer_does_not_advance_the_schedule(accelerator,
                                                                                                   tmp_path):
    """A GradScaler hands its found_inf to a fused optimizer (AdamW's default on CUDA), which skips inside its
    kernel, unseen by accelerate's optimizer_step_was_skipped. A real GradScaler and fused AdamW on CPU (fp16
    itself needs a GPU: tests/test_gpu.py runs it whole)."""
    torch.manual_seed(0)
    model = OverflowsOnCalls({3, 4, 7})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step + 1)  # a new rate at each step
    accelerator.scaler = torch.amp.GradScaler("cpu")
    try:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        trainer = OmegaConf.create({"compile": False, "compile_mode": "default", "nonfinite": "error",
                                    "max_consecutive_skips": 0, "max_grad_norm": None})
        train_step = TrainStep(accelerator, model, optimizer, scheduler, None, CrossEntropy(), trainer, tmp_path)
        batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
        scales, rates = [accelerator.scaler.get_scale()], [scheduler.get_last_lr()[0]]
        for step in range(8):
            train_step([batch], step)
            scales.append(accelerator.scaler.get_scale())
            rates.append(scheduler.get_last_lr()[0])
    finally:
        accelerator.scaler = None
    skipped = [step for step in range(1, 9) if scales[step] < scales[step - 1]]
    assert skipped == [3, 4, 7], scales
    assert [rates[step] - rates[step - 1] for step in range(1, 9)] == [0 if s in skipped else 1 for s in range(1, 9)]

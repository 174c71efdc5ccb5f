"""Checkpoints never lose a run: a killed run resumes to exactly the uninterrupted run's losses."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from src.checkpointing.checksums import SHARD_SUMS, checksum, write_checksums
from src.checkpointing.layout import STATE_FILE
from src.checkpointing.plain_state import load_tree, save_tree
from src.errors import UsageError
from src.optim.schedules import warmup_cosine
from tests.conftest import (
    QUIET,
    ROOT,
    TINY_GPT,
    exported_weights,
    free_port,
    kill_when,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
    snapshot,
)


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    """20 kB of Shakespeare: an epoch is a few dozen optimizer steps, so runs cross epoch boundaries."""
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:20000])
    return path


def resumable_args(small_text: Path, max_steps: int) -> list[str]:
    # Dropout on, so resuming must also restore the RNG; accumulation 2, shuffled, several epochs.
    return [*TINY_GPT, "model.dropout=0.1", *QUIET, f"data.path={small_text}", "data.batch_size=4",
            "trainer.gradient_accumulation_steps=2", f"trainer.max_steps={max_steps}", "trainer.checkpoint_every=10",
            "trainer.monitor=null", "trainer.keep_last_checkpoints=20"]


def step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("nproc, extra, killed_extra", [
    (1, ["data.random_offset=true"], ["trainer.async_checkpoint=true"]),
    (2, ["data.random_windows=true"], ["trainer.async_checkpoint=true"])])
def test_resume_after_sigkill_mid_epoch_reproduces_every_loss_of_the_uninterrupted_run(tmp_path, small_text, nproc,
                                                                                       extra, killed_extra):
    """With data.random_offset or data.random_windows, whose windows move every epoch (the run crosses several).
    The killed run writes its checkpoints in the background (trainer.async_checkpoint): resumed, it is still
    bitwise the uninterrupted run, which saved blocking."""
    max_steps = 90
    reference, resumed = tmp_path / "uninterrupted", tmp_path / "killed"
    run([*resumable_args(small_text, max_steps), *extra, f"hydra.run.dir={reference}"], nproc=nproc)

    args = [*resumable_args(small_text, max_steps), *extra, *killed_extra, f"hydra.run.dir={resumed}"]
    kill_when(args, nproc, ready=lambda: (resumed / "checkpoints" / "step_00000020").is_dir())
    assert not (resumed / "model").exists()  # it really died before the end
    proc = run([*args, "resume=auto"], nproc=nproc)
    assert "resumed from" in proc.stdout

    expected, got = scalars(reference, "train/loss"), scalars(resumed, "train/loss")
    assert sorted(got) == list(range(1, max_steps + 1))  # no duplicated or missing steps
    assert got == expected  # bitwise: float32 values as logged
    assert scalars(resumed, "train/lr") == scalars(reference, "train/lr")
    assert max_abs_diff(exported_weights(reference), exported_weights(resumed)) == 0
    assert sorted(scalars(resumed, "checkpoint/blocking_s"))[-3:] == [70, 80, 90]  # how long each save held the loop
    periodic = [line for line in (resumed / "train.log").read_text().splitlines()
                if "saved checkpoint" in line and "step_00000090" not in line]  # the final save blocks
    assert periodic and all("written in the background" in line for line in periodic), periodic


@pytest.fixture(scope="module")
def two_epoch_text(tmp_path_factory) -> Path:
    """8 kB: 28 optimizer steps of global batch 8 per epoch, so a 60-step run crosses two epoch boundaries."""
    path = tmp_path_factory.mktemp("text") / "two_epochs.txt"
    path.write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:8000])
    return path


def global_batch_8_args(text: Path) -> list[str]:
    return [*TINY_GPT, *QUIET, f"data.path={text}", "data.batch_size=4", "trainer.max_steps=60",
            "trainer.checkpoint_every=10", "trainer.monitor=null", "trainer.keep_last_checkpoints=20",
            "scheduler.warmup_steps=10"]


@pytest.fixture(scope="module")
def uninterrupted_global_batch_8(two_epoch_text, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("layout") / "uninterrupted"
    run([*global_batch_8_args(two_epoch_text), "trainer.gradient_accumulation_steps=1", f"hydra.run.dir={run_dir}"],
        nproc=2)
    return run_dir


@pytest.mark.parametrize("before, after", [((2, 1), (1, 2)), ((1, 2), (2, 1))],
                         ids=["2_processes_to_1_with_accumulation_2", "1_process_accumulating_2_to_2_processes"])
def test_a_checkpoint_resumes_on_another_number_of_processes_with_the_same_global_batch(
        tmp_path, two_epoch_text, uninterrupted_global_batch_8, before, after):
    """Killed after crossing an epoch boundary, resumed on the other layout of global batch 8 (batch 4 x
    processes x accumulation): every step's loss and the final weights match the uninterrupted 2-process run."""
    (nproc, accumulation), (new_nproc, new_accumulation) = before, after
    run_dir = tmp_path / "run"
    args = [*global_batch_8_args(two_epoch_text), f"hydra.run.dir={run_dir}"]
    kill_when([*args, f"trainer.gradient_accumulation_steps={accumulation}"], nproc,
              ready=lambda: (run_dir / "checkpoints" / "step_00000030").is_dir())
    assert not (run_dir / "model").exists()
    proc = run([*args, f"trainer.gradient_accumulation_steps={new_accumulation}", "resume=auto"], nproc=new_nproc)
    assert "resumed from" in proc.stdout and "epoch 1," in proc.stdout  # mid-way through the second epoch
    assert "not bitwise" in proc.stdout  # a new split of the global batch is said to be a new random stream

    expected, got = scalars(uninterrupted_global_batch_8, "train/loss"), scalars(run_dir, "train/loss")
    assert sorted(got) == list(range(1, 61))
    assert max(abs(got[step] - expected[step]) for step in expected) <= 1e-5
    assert max_abs_diff(exported_weights(uninterrupted_global_batch_8), exported_weights(run_dir)) <= 1e-5


def test_resuming_with_another_global_batch_is_refused_naming_the_accumulation_that_keeps_it(
        tmp_path, two_epoch_text, uninterrupted_global_batch_8):
    fork = tmp_path / "fork"
    checkpoint = uninterrupted_global_batch_8 / "checkpoints" / "step_00000030"
    proc = run([*global_batch_8_args(two_epoch_text), f"resume={checkpoint}", f"hydra.run.dir={fork}"], check=False)
    refused(proc, str(checkpoint), "8 samples", "4 (", "trainer.gradient_accumulation_steps=2",  # what keeps it
            "trainer.resume_with_new_global_batch=true")  # or what trains on with 4
    assert not any(fork.rglob("*.safetensors"))
    typed = run([*global_batch_8_args(two_epoch_text), f"resume={checkpoint}", "trainer.gradient_accumulation_steps=2",
                 "trainer.max_steps=31", f"hydra.run.dir={fork}"])  # the suggestion, as a user types it
    assert "resumed from" in typed.stdout


def test_with_resume_with_new_global_batch_a_process_count_that_cannot_keep_it_trains_on_with_its_own(
        tmp_path, two_epoch_text, uninterrupted_global_batch_8):
    """8 samples a step on 2 processes, resumed on 1 process with 6 a step (no accumulation keeps 8 with batch
    6): mid-way through the second epoch, 16 samples in, the next micro-step of 6 starts at 18; the run goes on to
    its last step with the checkpoint's weights, optimizer and schedule."""
    fork = tmp_path / "fork"
    checkpoint = uninterrupted_global_batch_8 / "checkpoints" / "step_00000030"
    proc = run([*global_batch_8_args(two_epoch_text), "data.batch_size=6", "trainer.resume_with_new_global_batch=true",
                f"resume={checkpoint}", f"hydra.run.dir={fork}"])
    named(proc.stdout, "resumed from", "epoch 1, 18 samples in", "global batch changes from 8 samples per optimizer "
          "step", "to 6", "2 samples of epoch 1 are passed over")
    expected, got = scalars(uninterrupted_global_batch_8, "train/loss"), scalars(fork, "train/loss")
    assert sorted(got) == list(range(31, 61)) and abs(got[31] - expected[31]) < 0.3  # trained on, not restarted
    assert json.loads((fork / "checkpoints" / "step_00000060" / STATE_FILE).read_text())["batch_size"] == 6


def test_a_stream_cannot_take_a_new_global_batch_on_resume(tmp_path):
    """data=stream's loaders keep each process's own place in the stream: no sample count continues it, so the flag
    is not offered to it, and it is refused as without the flag."""
    from src.checkpointing.load import _check_layout
    from src.loop.train_state import TrainState

    saved = {"step": 30, "batch_size": 4, "num_processes": 2, "gradient_accumulation_steps": 1}
    state = TrainState(batch_size=6, num_processes=1, gradient_accumulation_steps=1)
    assert not _check_layout(saved, state, tmp_path, new_global_batch=True)  # a new layout, accepted
    with pytest.raises(UsageError) as error:
        _check_layout(saved, state, tmp_path, new_global_batch=True, stream=True)
    assert "another global batch" in str(error.value) and "resume_with_new_global_batch" not in str(error.value)


def test_a_new_global_batch_needs_the_runs_length_in_steps_not_epochs(tmp_path):
    from src.checkpointing.load import check_a_new_global_batch_fits
    from src.loop.train_state import TrainState

    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 80, "batch_size": 4, "num_processes": 1,
                                                   "gradient_accumulation_steps": 1}))
    new, same = (TrainState(batch_size=b, num_processes=1, gradient_accumulation_steps=1) for b in (6, 4))
    with pytest.raises(UsageError) as error:
        check_a_new_global_batch_fits(tmp_path, new, max_epochs=2)
    named(str(error.value), "trainer.max_epochs=2", "step 80", "trainer.max_steps=N")
    check_a_new_global_batch_fits(tmp_path, new, max_epochs=None)  # a length in steps
    check_a_new_global_batch_fits(tmp_path, same, max_epochs=2)  # the same global batch


@pytest.mark.slow  # 9 s of image training and loader workers (the suite's time: issue 48); CI runs it
def test_resume_reproduces_augmented_image_training_with_loader_workers(tmp_path, cifar_root):
    """Random crops and flips in two DataLoader workers, BatchNorm, accumulation: still bitwise after a kill.
    With trainer.deterministic, whose kernels every op of the model and loss must have."""
    args = ["experiment=cifar10_resnet", f"data.root={cifar_root}", "model.width=8", "data.batch_size=16",
            "data.num_workers=2", "data.prefetch_factor=4", "trainer.gradient_accumulation_steps=2", "trainer.max_steps=45",
            "trainer.checkpoint_every=10", "trainer.monitor=null", "trainer.keep_last_checkpoints=20",
            "trainer.deterministic=true", *QUIET]
    reference, resumed = tmp_path / "uninterrupted", tmp_path / "killed"
    assert "deterministic kernels       : True" in run([*args, f"hydra.run.dir={reference}"]).stdout
    kill_when([*args, f"hydra.run.dir={resumed}"], 1,
              ready=lambda: (resumed / "checkpoints" / "step_00000020").is_dir())
    run([*args, f"hydra.run.dir={resumed}", "resume=auto"])
    assert scalars(resumed, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(resumed)) == 0


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path, small_text):
    run_dir = tmp_path / "run"
    # A wider model so that a save takes long enough to be caught in the middle.
    args = [*resumable_args(small_text, 40), "model.n_embd=256", "trainer.checkpoint_every=5",
            f"hydra.run.dir={run_dir}"]
    in_save = lambda: (run_dir / "checkpoints" / "step_00000005").is_dir() and any(  # noqa: E731
        (run_dir / "checkpoints").glob(".tmp-step_*"))
    kill_when(args, 1, ready=in_save)
    assert list((run_dir / "checkpoints").glob(".tmp-step_*"))  # killed mid-save: a partial save is left
    complete = step_dirs(run_dir)
    assert complete and all(len(list((run_dir / "checkpoints" / d).iterdir())) >= 5 for d in complete)
    proc = run([*args, "resume=auto"])
    assert f"resumed from {run_dir / 'checkpoints' / complete[-1]}" in proc.stdout
    assert sorted(scalars(run_dir, "train/loss")) == list(range(1, 41))
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the next save cleaned the partial one


def test_rotation_keeps_the_newest_complete_checkpoints_and_the_best_one_apart(tmp_path):
    run_dir = tmp_path / "run"
    # monitor the loss with mode=max: the best checkpoint is an early one, which rotation must spare.
    run([*TINY_GPT, *QUIET, "trainer.max_steps=16", "trainer.checkpoint_every=2", "trainer.keep_last_checkpoints=3",
         "trainer.eval_every=4", "trainer.monitor=eval/loss", "trainer.monitor_mode=max", "optimizer.lr=3e-3",
         f"hydra.run.dir={run_dir}"])
    eval_loss = scalars(run_dir, "eval/loss")
    best = max(eval_loss, key=eval_loss.get)
    assert best < 12
    assert step_dirs(run_dir) == sorted({f"step_{s:08d}" for s in (best, 12, 14, 16)})
    best_weights = load_file(run_dir / "checkpoints" / f"step_{best:08d}" / "model.safetensors")
    assert max_abs_diff(load_file(run_dir / "model_best" / "model.safetensors"), best_weights) == 0


@pytest.fixture(scope="module")
def finished_run_original(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run([*TINY_GPT, *QUIET, "trainer.max_steps=6", "trainer.checkpoint_every=3", f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.fixture
def finished_run(finished_run_original, tmp_path) -> Path:
    """A 6-step run with checkpoints at steps 3 and 6, each test's own copy to resume, damage or refuse."""
    return Path(shutil.copytree(finished_run_original, tmp_path / "run"))


def test_a_new_run_into_an_occupied_run_dir_is_refused_and_changes_no_file(finished_run):
    before = snapshot(finished_run)
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=6", f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, str(finished_run), "resume=auto", "hydra.run.dir=")
    assert snapshot(finished_run) == before
    run([*TINY_GPT, *QUIET, "trainer.max_steps=6", "resume=auto", f"hydra.run.dir={finished_run}"])  # as suggested


def test_resume_refuses_an_override_that_changes_the_model_and_changes_no_file(finished_run):
    before = snapshot(finished_run)
    proc = run([*TINY_GPT, *QUIET, "model.n_layer=3", "trainer.max_steps=6", "resume=auto",
                f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, "model.n_layer=3", "2)")
    assert snapshot(finished_run) == before


def test_resume_refuses_an_experiment_that_changes_the_setup(finished_run):
    proc = run([*QUIET, "experiment=cifar10_resnet", "resume=auto", f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, "model._target_=src.models.resnet.ResNet")


def test_resume_accepts_and_logs_a_longer_max_steps_and_keeps_the_schedule_it_started_with(tmp_path):
    args = [*TINY_GPT, *QUIET, "scheduler.warmup_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    run([*args, "trainer.max_steps=6"])
    proc = run([*args, "trainer.max_steps=9", "resume=auto"])
    named(proc.stdout, "trainer.max_steps: 6 -> 9", "scheduler.total_steps=6")
    assert sorted(scalars(tmp_path / "run", "train/loss")) == list(range(1, 10))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule = warmup_cosine(optimizer, total_steps=6, warmup_steps=2)
    rates = []
    for _ in range(9):  # train/lr after step s is the rate of the schedule's position s
        optimizer.step()
        schedule.step()
        rates.append(schedule.get_last_lr()[0])
    lr = scalars(tmp_path / "run", "train/lr")
    assert [lr[step] for step in range(1, 10)] == pytest.approx(rates, rel=1e-6)


def test_resume_from_a_truncated_checkpoint_names_the_file(finished_run):
    optimizer_file = finished_run / "checkpoints" / "step_00000006" / "optimizer.safetensors"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:1000])
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=6", "resume=auto", f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, str(optimizer_file), "resume=PATH")
    older = finished_run / "checkpoints" / "step_00000003"  # the suggestion, typed
    resumed = run([*TINY_GPT, *QUIET, "trainer.max_steps=6", f"resume={older}", f"hydra.run.dir={finished_run}"])
    assert "resumed from" in resumed.stdout


def test_resume_from_a_checkpoint_corrupted_mid_file_names_the_file(finished_run):
    """The header is intact, only tensor bytes are wrong: safetensors alone would load them silently."""
    optimizer_file = finished_run / "checkpoints" / "step_00000006" / "optimizer.safetensors"
    data = bytearray(optimizer_file.read_bytes())
    middle = len(data) // 2  # within the tensors: the header is a few kB at the start
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    optimizer_file.write_bytes(bytes(data))
    with safe_open(optimizer_file, framework="pt"):  # the corruption passes safetensors' own check
        pass
    from src.checkpointing.integrity import check_readable

    # The check before the config is read leaves the weights' and states' bytes to the rank that reads them (no
    # rank reads the whole checkpoint twice): that rank refuses them.
    check_readable(optimizer_file.parent)
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, str(optimizer_file), "CRC mismatch")


def test_a_checkpoint_corrupted_mid_file_is_refused_as_another_runs_starting_weights_too(finished_run, tmp_path):
    checkpoint = finished_run / "checkpoints" / "step_00000006"
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4] ^= 0x01  # the last value of the last tensor
    weights.write_bytes(bytes(data))
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=1", f"trainer.init_weights={checkpoint}",
                f"hydra.run.dir={tmp_path / 'anew'}"], check=False)
    refused(proc, str(weights), "CRC mismatch")


def test_resume_refuses_an_optimizer_state_whose_hyperparameters_are_not_its_configs(finished_run):
    """torch would take the file's betas over the config's without a word: a checkpoint edited (its checksums
    rewritten, as a hand-made one would have them) or assembled from two runs."""
    checkpoint = finished_run / "checkpoints" / "step_00000006"
    state = load_tree(checkpoint / "optimizer.safetensors")
    assert state["param_groups"][0]["betas"] == (0.9, 0.99)  # adamw's default, as saved
    state["param_groups"][0]["betas"] = (0.9, 0.5)
    save_tree(state, checkpoint / "optimizer.safetensors")
    write_checksums(checkpoint)
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=9", "resume=auto", f"hydra.run.dir={finished_run}"],
               check=False)
    refused(proc, str(checkpoint / "optimizer.safetensors"), "betas=(0.9, 0.5)", "(0.9, 0.99)")
    assert not (finished_run / "checkpoints" / "step_00000009").exists()


def test_resume_from_a_checkpoint_whose_model_shape_differs_names_the_tensor_and_changes_no_file(finished_run):
    """As after an edit of the model's code: the config builds a model the saved tensors do not fit."""
    model_file = finished_run / "checkpoints" / "step_00000006" / "model.safetensors"
    weights = load_file(model_file)
    weights["blocks.0.attn.proj.weight"] = weights["blocks.0.attn.proj.weight"][:-1].contiguous()
    save_file(weights, model_file, metadata={"format": "pt"})
    write_checksums(model_file.parent)  # as if written so: the file is intact, the model no longer fits it
    before = snapshot(finished_run)
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, str(model_file.parent), "blocks.0.attn.proj.weight", "torch.Size([31, 32])", "torch.Size([32, 32])")
    assert snapshot(finished_run) == before


def test_resume_without_the_rank_rng_state_fails_loudly(finished_run):
    (finished_run / "checkpoints" / "step_00000006" / "random_states_0.safetensors").unlink()
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={finished_run}"], check=False)
    refused(proc, str(finished_run / "checkpoints" / "step_00000006" / "random_states_0.safetensors"))


def test_resume_from_an_explicit_checkpoint_path_continues_into_a_new_run_dir(finished_run, tmp_path):
    fork = tmp_path / "fork"
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=6", f"resume={finished_run / 'checkpoints' / 'step_00000003'}",
                f"hydra.run.dir={fork}"])
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert max_abs_diff(exported_weights(fork), exported_weights(finished_run)) == 0


def test_a_rewind_to_an_earlier_checkpoint_of_the_same_run_dir_sets_the_later_ones_aside_and_saves_its_own(
        finished_run):
    """Left in place, step 6 of the abandoned timeline would not be saved again (it exists) and resume=auto would
    continue it."""
    later = finished_run / "checkpoints" / "step_00000006"
    before = snapshot(later)
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=6", f"resume={finished_run / 'checkpoints' / 'step_00000003'}",
                f"hydra.run.dir={finished_run}"])
    (aside,) = (finished_run / "checkpoints").glob("superseded_*")
    named(proc.stdout, "step_00000006 moved to", str(aside))
    assert snapshot(aside / "step_00000006") == before  # whole, untouched
    assert later.is_dir() and snapshot(later) != before  # this run's own step 6, written anew
    resumed = run([*TINY_GPT, *QUIET, "trainer.max_steps=6", "resume=auto", f"hydra.run.dir={finished_run}"])
    assert "step_00000006" in resumed.stdout and "superseded" not in resumed.stdout


def fsdp_shaped_checkpoint(directory: Path) -> Path:
    """A checkpoint laid out as the checkpointer writes it under FSDP: model and optimizer state as directories of
    one safetensors file per rank (two ranks' halves here, written as src/checkpointing/plain_state.py's writer
    lays them out), the optimizer's plain values, schedule and random state as JSON and safetensors."""
    import json as json_module

    import torch
    from torch.distributed.checkpoint._hf_utils import (
        CUSTOM_METADATA_KEY,
        SAVED_OFFSETS_KEY,
    )

    from src.checkpointing.plain_state import save_tree, shard_file_name

    checkpoint = directory / "step_00000010"
    for state, prefix in (("pytorch_model_fsdp_0", "model"), ("optimizer_0", "optimizer.state.weight")):
        (checkpoint / state).mkdir(parents=True)
        whole = torch.randn(64, 64)
        for rank in range(2):
            name = f"{prefix}.exp_avg" if state == "optimizer_0" else f"{prefix}.weight"
            offsets = {name: {SAVED_OFFSETS_KEY: [32 * rank, 0]}}
            save_file({name: whole[32 * rank: 32 * (rank + 1)].contiguous()},
                      checkpoint / state / shard_file_name(rank + 1, 2),
                      metadata={CUSTOM_METADATA_KEY: json_module.dumps(offsets), "format": "pt"})
    save_tree({"param_groups": [{"lr": 0.1, "params": ["weight"]}]}, checkpoint / "optimizer_0" / "plain_values.json")
    save_tree({"last_epoch": 10}, checkpoint / "scheduler.json")
    save_tree({"step": 10, "torch_manual_seed": torch.get_rng_state()}, checkpoint / "random_states_0.safetensors")
    (checkpoint / "train_state.json").write_text(json_module.dumps({"step": 10}))
    (checkpoint / "run_config.yaml").write_text("trainer: {}\n")
    folders = [checkpoint / "pytorch_model_fsdp_0", checkpoint / "optimizer_0"]
    for folder in folders:  # the CRCs each rank's writer reports of its shard (src/checkpointing/plain_state.py)
        (folder / SHARD_SUMS).write_text(json_module.dumps({f.name: checksum(f) for f in folder.glob("shard-*")}))
    write_checksums(checkpoint, folders)
    return checkpoint


def test_sharded_checkpoint_directories_are_fsynced_and_accepted_and_a_truncated_or_missing_shard_is_named(
        tmp_path):
    from src.checkpointing.checkpointer import _fsync_tree
    from src.checkpointing.integrity import check_readable

    checkpoint = fsdp_shaped_checkpoint(tmp_path)
    _fsync_tree(checkpoint)  # opens directories as directories, not as files
    check_readable(checkpoint)  # no model.safetensors, and that is fine here
    shard = checkpoint / "optimizer_0" / "shard-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UsageError) as error:
        check_readable(checkpoint)
    named(str(error.value), f"checkpoint file {checkpoint / 'optimizer_0'} is corrupt or truncated", str(shard))
    intact = fsdp_shaped_checkpoint(tmp_path / "other")
    (intact / "pytorch_model_fsdp_0" / "shard-00002-of-00002.safetensors").unlink()  # a rank's part lost
    with pytest.raises(UsageError) as error:
        check_readable(intact)
    named(str(error.value), str(intact / "pytorch_model_fsdp_0" / "shard-00002-of-00002.safetensors"))


def test_shards_that_leave_part_of_a_tensor_uncovered_are_refused(tmp_path):
    """Every rank's file present and intact, yet one holds another part than it should: a hole in the tensor."""
    import json as json_module

    from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY

    from src.checkpointing.integrity import check_readable

    checkpoint = fsdp_shaped_checkpoint(tmp_path)
    shard = checkpoint / "pytorch_model_fsdp_0" / "shard-00002-of-00002.safetensors"
    with safe_open(shard, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, shard, metadata={CUSTOM_METADATA_KEY: json_module.dumps(
        {"model.weight": {"saved_offsets": [40, 0]}}), "format": "pt"})  # rows 40-72 of 72: 32-40 uncovered
    with pytest.raises(UsageError) as error:
        check_readable(checkpoint)
    named(str(error.value), str(checkpoint / "pytorch_model_fsdp_0"), "model.weight")


def test_the_optimizer_step_after_a_background_sharded_save_waits_for_the_copy_of_the_shards():
    """Under FSDP a background save copies the shards to host memory while the next forward and backward run
    (they only read them); the step that changes them must wait for the copy, or the checkpoint would hold some of
    the next step's values. In-process: the hook the checkpointer registers, on a plain optimizer."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from src.checkpointing.checkpointer import Checkpointer

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    checkpointer = Checkpointer.__new__(Checkpointer)  # only what a background sharded save reads
    checkpointer.accelerator = SimpleNamespace(_optimizers=[SimpleNamespace(optimizer=optimizer)])
    checkpointer.staging = []
    checkpointer._each_step_waits_for_the_copies()  # at the run's first one: from here on every step waits
    waited_on = []  # the weights as they were when the step waited for the copy

    class Copy(Future):
        def result(self, timeout=None):
            waited_on.append(weight.detach().clone())
            return super().result(timeout)

    copy = Copy()
    copy.set_result(None)
    checkpointer.staging.append(copy)
    weight.grad = torch.ones(4)
    optimizer.step()
    assert len(waited_on) == 1 and torch.equal(waited_on[0], torch.ones(4))  # before the step changed them
    assert torch.equal(weight.detach(), torch.zeros(4)) and checkpointer.staging == []


@pytest.mark.parametrize("layout", ["fsdp1", "full_state_dict", "deepspeed"])
def test_a_layout_whose_checkpoints_would_not_be_ours_is_refused_before_training(layout):
    """FSDP's first version, gathered state dicts and DeepSpeed save through their own (pickled) formats: refused
    at the start, naming the key that chooses them, rather than at the first save."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import StateDictType

    from src.checkpointing.training_state import check_supported

    plugin = SimpleNamespace(fsdp_version=1 if layout == "fsdp1" else 2,
                             state_dict_type=StateDictType.FULL_STATE_DICT if layout == "full_state_dict"
                             else StateDictType.SHARDED_STATE_DICT)
    kind = DistributedType.DEEPSPEED if layout == "deepspeed" else DistributedType.FSDP
    with pytest.raises(UsageError) as error:
        check_supported(SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin)))
    named(str(error.value), *(["DEEPSPEED"] if layout == "deepspeed" else ["fsdp_version", "SHARDED_STATE_DICT"]))
    plugin.fsdp_version, plugin.state_dict_type = 2, StateDictType.SHARDED_STATE_DICT  # config/accelerate/fsdp.yaml's
    check_supported(SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin)))


def test_every_rank_resumes_the_checkpoint_rank_0_sees_or_the_launch_stops_naming_both(tmp_path):
    """On NFS a rank's cached listing of the run dir can lag: resume=auto would pick another step on that rank.
    Rank 0's checkpoint wins where the config is the same; otherwise the launch stops (not a hang, not two steps)."""
    run_dir = tmp_path / "run"
    newest = fsdp_shaped_checkpoint(run_dir / "checkpoints")  # complete checkpoints, as the checkpointer lays them out
    older = Path(shutil.copytree(newest, newest.with_name("step_00000005")))
    script = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port()), "tests/stale_listing.py"]
    out = tmp_path / "agreed"
    ran = run([str(newest), str(older), "same-config", str(out)], command=script)
    assert [Path(f"{out}.rank{rank}").read_text() for rank in (0, 1)] == [str(newest)] * 2
    assert "rank 1 saw" in ran.stdout and str(older) in ran.stdout
    stopped = run([str(newest), "none", "other-config", str(tmp_path / "no")], command=script, check=False)
    assert stopped.returncode != 0 and not Path(f"{tmp_path / 'no'}.rank1").exists()
    named(stopped.stdout, "rank 1 would resume from no checkpoint", str(newest), "resume=PATH")

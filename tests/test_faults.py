"""Faults: a non-finite step never reaches a checkpoint or an export; skipped steps are counted and bounded."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

from src.optim.schedules import warmup_cosine
from tests.conftest import QUIET, TINY_GPT, exported_weights, max_abs_diff, named, refused, run, scalars

ARGS = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.checkpoint_every=1", "trainer.monitor=null",
        "scheduler.warmup_steps=2", "trainer.max_steps=8"]
NAN_MODEL = "model._target_=tests.components.NaNOnCalls"


def test_a_huge_learning_rate_stops_every_rank_at_the_first_nonfinite_step_and_saves_nothing_of_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*ARGS, "optimizer.lr=1e30", "trainer.max_grad_norm=0", f"hydra.run.dir={run_dir}"], nproc=2,
               check=False)
    assert proc.returncode != 0
    step = int(proc.stdout.split("step ", 1)[1].split(":")[0]) if "is not finite" in proc.stdout else None
    assert step is not None, proc.stdout[-3000:]
    named(proc.stdout, "optimizer.lr", "trainer.max_grad_norm", "trainer.nonfinite=skip")  # what to change
    assert f"{run_dir / 'checkpoints'} is intact" in proc.stdout
    assert 'train.py", line' not in proc.stdout  # the launcher prints its own traceback for a failed worker
    assert not (run_dir / "model").exists() and not (run_dir / "model_best").exists()
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].name.split("_")[1]) == step - 1  # the last good step, and nothing after it
    weights = load_file(saved[-1] / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())


def test_a_nonfinite_step_between_logs_stops_the_run_at_the_next_logging_step_with_nothing_of_it_saved(tmp_path):
    """error mode reads its verdict only where something is logged or saved: the run stops there, naming the step."""
    run_dir = tmp_path / "run"
    proc = run([*ARGS, NAN_MODEL, "+model.nan_calls=[6]", "trainer.log_every=4", "trainer.checkpoint_every=4",
                f"hydra.run.dir={run_dir}"], nproc=2, check=False)
    assert proc.returncode != 0
    assert re.search(r"step 6: .*not finite", proc.stdout), proc.stdout[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_00000004"]
    assert list(scalars(run_dir, "train/loss")) == [4] and not (run_dir / "model").exists()


def test_skip_mode_skips_and_counts_nonfinite_steps_without_advancing_the_schedule(tmp_path):
    run_dir = tmp_path / "run"
    run([*ARGS, NAN_MODEL, "+model.nan_calls=[3,4]", "trainer.nonfinite=skip", f"hydra.run.dir={run_dir}"])
    skipped, lr = scalars(run_dir, "train/skipped_steps"), scalars(run_dir, "train/lr")
    assert skipped[2] == 0 and skipped[3] == 1 and skipped[8] == 2
    assert lr[3] == lr[4] == lr[2]  # the schedule stood still while steps were skipped
    assert all(math.isfinite(v) for v in scalars(run_dir, "eval/loss").values())
    assert all(t.isfinite().all() for t in load_file(run_dir / "model" / "model.safetensors").values())


def test_skip_mode_without_host_reads_skips_on_the_device_with_the_weights_and_schedule_of_reading_each_step(tmp_path):
    """A fused optimizer skips a bad step itself (found_inf); the host learns of it at the next logging step and
    moves the schedule back. Read at once (log_every=1) or 2 steps later, the run ends bitwise the same."""
    args = [*ARGS, NAN_MODEL, "+model.nan_calls=[3,4]", "trainer.nonfinite=skip", "optimizer.fused=true"]
    for name, every in (("at_once", 1), ("later", 4)):
        run([*args, f"trainer.log_every={every}", f"hydra.run.dir={tmp_path / name}"], nproc=2)
    for tag in ("train/skipped_steps", "train/lr", "train/loss"):
        later = scalars(tmp_path / "later", tag)
        at_once = {step: v for step, v in scalars(tmp_path / "at_once", tag).items() if step in later}
        assert repr(later) == repr(at_once), tag  # repr: a skipped step's NaN loss equals itself
    assert scalars(tmp_path / "later", "train/skipped_steps")[8] == 2
    assert max_abs_diff(exported_weights(tmp_path / "at_once"), exported_weights(tmp_path / "later")) == 0
    schedule = warmup_cosine(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), total_steps=8,
                             warmup_steps=2)
    positions = {}
    for position in range(7):
        positions[position] = schedule.get_last_lr()[0]
        schedule.step()
    lr = scalars(tmp_path / "later", "train/lr")  # after 4 and 8 steps, 2 of them skipped: positions 2 and 6
    assert lr[4] == pytest.approx(positions[2], rel=1e-6) and lr[8] == pytest.approx(positions[6], rel=1e-6)


def test_skip_mode_stops_after_too_many_consecutive_skips(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*ARGS, NAN_MODEL, "+model.nan_calls=[3,4,5]", "trainer.nonfinite=skip",
                "trainer.max_consecutive_skips=2", f"hydra.run.dir={run_dir}"], check=False)
    refused(proc, "step 5", "trainer.max_consecutive_skips=2", str(run_dir / "checkpoints"))
    assert not (run_dir / "model").exists()


def test_a_nonfinite_evaluation_is_reported_and_never_becomes_the_best_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run([*ARGS, "model._target_=tests.components.NaNWhenEvaluating", "trainer.monitor=eval/loss",
         "trainer.eval_every=4", f"hydra.run.dir={run_dir}"])
    assert all(math.isnan(v) for v in scalars(run_dir, "eval/loss").values())  # reported as such
    assert not (run_dir / "model_best").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["step"] is None and math.isnan(summary["final_metrics"]["eval/loss"])


def end_launch(proc, stopped_worker=None) -> None:
    """SIGKILL a worker a test stopped (it cannot act on the launcher's SIGTERM) and the launch, if still there."""
    import os
    import signal

    if stopped_worker:
        try:
            os.kill(stopped_worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
def test_a_stopped_rank_makes_the_other_report_its_stacks_and_the_launch_end_nonzero_within_the_timeout(tmp_path):
    import os
    import signal
    import time

    from tests.conftest import start, wait_for, worker_pids

    run_dir = tmp_path / "run"
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.max_steps=100000", "trainer.checkpoint_every=5",
            "trainer.hang_report_s=4", "trainer.dist_timeout_s=10", f"hydra.run.dir={run_dir}"]
    proc = start(args, nproc=2, launcher="torchrun")
    stopped = None
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_00000005").is_dir() and len(worker_pids(proc.pid)) == 2, proc)
        workers = worker_pids(proc.pid)
        rank0, stopped = workers[0], workers[1]
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        while os.path.exists(f"/proc/{rank0}") and time.monotonic() - started < 90:
            time.sleep(0.2)
        # Rank 0 ended by itself: the collective timeout (10 s), not a 30-minute wait. torchrun then gives the
        # stopped rank a fixed 30 s to act on SIGTERM, which it cannot; end it now instead.
        assert not os.path.exists(f"/proc/{rank0}"), "rank 0 is still waiting"
        os.kill(stopped, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert "HANG? rank 0 (pid" in output and "no optimizer step finished" in output, output[-4000:]
        report = output.split("HANG? rank 0", 1)[1]
        assert "Thread MainThread:" in report and 'train.py", line' in report  # where rank 0 waits
        assert "HANG? rank 1" not in output  # the stopped rank says nothing: that is how it shows
        assert f"Not answering: rank 1 (pid {stopped} on {os.uname().nodename}: last finished step" in report
        # The end, in our words: which rank, not gloo's RuntimeError and a traceback of the loop.
        named(output, "trainer.dist_timeout_s=10", f"Not answering: rank 1 (pid {stopped}")
        assert "RuntimeError: [" not in output
    finally:
        end_launch(proc, stopped)


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
def test_a_long_evaluation_is_no_hang_but_a_rank_stopped_inside_one_is_reported(tmp_path):
    """Evaluations longer than trainer.hang_report_s report their progress batch by batch: the one at step 2
    passes without a report (a 206M-parameter model's final evaluation ran past 300 s and every rank was
    reported), and so does rank 1 waiting while rank 0 alone samples texts for longer than that. Rank 1 stopped
    inside the evaluation at step 4: rank 0, waiting in its collective, reports where."""
    import os
    import signal
    import time

    from tests.conftest import start, wait_for, worker_pids

    run_dir = tmp_path / "run"
    args = [*TINY_GPT, "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_batches=null", "data.batch_size=4",
            "data.eval_batch_size=1", "trainer.max_steps=100000", "trainer.checkpoint_every=0", "trainer.monitor=null",
            "trainer.hang_report_s=2", "trainer.dist_timeout_s=10", f"hydra.run.dir={run_dir}",
            "model._target_=tests.components.SlowToSample", "+model.sample_seconds=1.2", "trainer.sample_every=2",
            "trainer.sample_tokens=4", "trainer.sample_prompts=[A,B,C]"]  # 3.6 s of sampling after step 2's eval
    proc = start(args, nproc=2, launcher="torchrun")
    stopped = None
    try:
        wait_for(lambda: (run_dir / "tensorboard").is_dir() and 4 in scalars(run_dir, "train/loss"), proc)
        stopped = worker_pids(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)  # in step 4's evaluation: logged, then evaluated
        deadline = time.monotonic() + 90
        while proc.poll() is None and "HANG? rank 0" not in (run_dir / "train.log").read_text():
            assert time.monotonic() < deadline, "no report"
            time.sleep(0.2)
        os.kill(stopped, signal.SIGKILL)
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode != 0 and not (run_dir / "summary.json").exists()  # the run did not finish
        reports = [line[line.index("HANG?"):] for line in output.splitlines() if "HANG? rank" in line]
        assert reports and all(r.startswith("HANG? rank 0") and "after step 4" in r for r in reports), reports
        assert "the last progress: evaluation batch" in reports[0], reports[0]
        assert "step 2: eval/loss=" in output, output[-3000:]  # the first evaluation ran to its end, unreported
        assert "sample 2 at step 2" in output, output[-3000:]  # and the sampling after it
    finally:
        end_launch(proc, stopped)


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
def test_workers_stop_when_their_launcher_is_killed_instead_of_training_on_orphaned(tmp_path):
    """torch's elastic agent starts workers in their own sessions: a `kill -9` of `accelerate launch` alone
    would leave them writing into a run dir that the resumed run then shares."""
    import os
    import signal
    import subprocess
    import time

    from tests.conftest import ROOT, launch_command, wait_for, worker_pids

    run_dir = tmp_path / "run"
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.max_steps=100000", "trainer.checkpoint_every=5",
            f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(launch_command("train.py", 2) + args, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    workers = {}
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_00000005").is_dir() and len(worker_pids(proc.pid)) == 2, proc)
        workers = worker_pids(proc.pid)
        proc.kill()  # the launcher only, as `kill -9 PID` would
        proc.wait()
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in workers.values()), "a worker trains on"
        assert f"the launcher (pid {proc.pid}) is gone" in (run_dir / "train.log").read_text()
    finally:
        for pid in workers.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("writing", [[], ["trainer.async_checkpoint=true"]])  # blocking, then in the background
def test_a_full_disk_during_a_save_names_the_path_and_leaves_the_previous_checkpoint_resumable(tmp_path, writing):
    """In the background the write fails on rank 0's thread: the next save stops the run with it."""
    import shutil
    import subprocess

    import pytest

    from src.checkpointing.integrity import check_readable
    from src.checkpointing.layout import complete_checkpoints

    mount = tmp_path / "small_disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): no full filesystem to test on")
    try:
        run_dir = mount / "run"
        args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.max_steps=40", "trainer.checkpoint_every=1",
                "trainer.keep_last_checkpoints=40", "trainer.monitor=null"]
        proc = run([*args, *writing, f"hydra.run.dir={run_dir}"], check=False)
        refused(proc, str(run_dir / "checkpoints" / "step_"), "MB are free", "resume=auto")
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # no half-written step_N
        saved = complete_checkpoints(run_dir)
        assert len(saved) >= 2
        for checkpoint in saved:
            check_readable(checkpoint)
        elsewhere = tmp_path / "resumed"  # on a disk with room, the newest checkpoint continues the run
        run([*args, f"resume={saved[-1]}", f"hydra.run.dir={elsewhere}"])
        assert sorted(scalars(elsewhere, "train/loss"))[-1] == 40
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        shutil.rmtree(mount, ignore_errors=True)

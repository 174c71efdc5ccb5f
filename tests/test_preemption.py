"""A stop signal saves a checkpoint and the resumed run ends where the uninterrupted one does."""

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import (
    QUIET,
    TINY_GPT,
    exported_weights,
    max_abs_diff,
    named,
    run,
    scalars,
    start,
    wait_for,
    worker_pids,
)

PREEMPTED_EXIT_CODE = 75


def args_for(run_dir: Path, max_steps: int = 400) -> list[str]:
    return [*TINY_GPT, "model.dropout=0.1", *QUIET, "data.batch_size=4", "trainer.gradient_accumulation_steps=2",
            f"trainer.max_steps={max_steps}", "trainer.checkpoint_every=10", "trainer.monitor=null",
            f"hydra.run.dir={run_dir}"]


def test_sigterm_saves_a_checkpoint_exits_with_the_preempted_status_and_resume_matches(tmp_path):
    reference, stopped = tmp_path / "uninterrupted", tmp_path / "stopped"
    run(args_for(reference, 60))
    proc = start(args_for(stopped, 60))
    wait_for(lambda: (stopped / "checkpoints" / "step_00000010").is_dir(), proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "stopping at step" in output and "on SIGTERM" in output
    assert not (stopped / "model").exists()
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["stopped"] == "preempted" and summary["steps"] < 60
    run([*args_for(stopped, 60), "resume=auto"])
    assert scalars(stopped, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(stopped)) == 0


@pytest.mark.slow  # 8 s; SIGTERM and Ctrl-C to the launch stay in the default suite; CI runs it
def test_a_signal_to_one_rank_stops_all_ranks_at_the_same_step_with_one_checkpoint(tmp_path):
    reference, stopped = tmp_path / "uninterrupted", tmp_path / "stopped"
    max_steps = 80
    run(args_for(reference, max_steps), nproc=2, launcher="torchrun")
    proc = start(args_for(stopped, max_steps), nproc=2, launcher="torchrun")
    wait_for(lambda: (stopped / "checkpoints" / "step_00000010").is_dir() and len(worker_pids(proc.pid)) == 2, proc)
    os.kill(worker_pids(proc.pid)[1], signal.SIGUSR1)  # rank 1 only
    output, _ = proc.communicate(timeout=120)
    assert "stopping at step" in output and "on a signal to another rank" in output  # rank 0's account
    newest = sorted((stopped / "checkpoints").glob("step_*"))[-1]
    assert {p.name for p in newest.glob("random_states_*")} == {f"random_states_{rank}.safetensors" for rank in (0, 1)}
    assert not (stopped / "model").exists()
    run([*args_for(stopped, max_steps), "resume=auto"], nproc=2, launcher="torchrun")
    assert scalars(stopped, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(stopped)) == 0


def test_ctrl_c_finishes_the_step_saves_and_says_how_to_resume_and_a_second_one_stops_at_once(tmp_path):
    """As a terminal sends it: SIGINT to the whole process group, the loader's workers included."""
    from src.checkpointing.layout import complete_checkpoints

    run_dir = tmp_path / "run"
    # Loader workers: they must live on after the Ctrl-C. No step logs or saves between 50 and 100.
    args = [a for a in args_for(run_dir, 100000) if not a.startswith(("trainer.log_every", "trainer.checkpoint"))]
    args += ["data.num_workers=2", "trainer.log_every=1000", "trainer.checkpoint_every=50"]
    proc = start(args)
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000050").is_dir(), proc)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    assert output.count("Interrupted:") == 1  # not the workers too
    assert "on SIGINT" in output
    named(output, f"resume=auto hydra.run.dir={run_dir}")  # how to continue
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    stopped_at = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert 50 < stopped_at < 100  # the step in progress, not the next one that logs or saves
    assert complete_checkpoints(run_dir)[-1].name == f"step_{stopped_at:08d}"

    # A second Ctrl-C while the first one's step is still running: steps of a larger model take long enough.
    run_dir = tmp_path / "run2"
    args = [*args_for(run_dir, 100000), "model.n_embd=128", "data.batch_size=32", "trainer.eval_batches=1",
            "trainer.checkpoint_every=2"]
    proc = start(args)
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000002").is_dir(), proc)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: "Interrupted: finishing the step" in proc.output(), proc)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Interrupted again" in output, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output and "stopping at step" not in output
    resumed = run([*args[:-1], "trainer.checkpoint_every=1000", "trainer.max_steps=5", "resume=auto"])
    assert "resumed from" in resumed.stdout  # what the second Ctrl-C left is a resumable run


def test_ctrl_c_to_a_two_process_launch_stops_both_ranks_at_one_step_with_one_checkpoint(tmp_path):
    """The launcher (torch's elastic agent) passes the SIGINT on to its workers; it then reports the signal
    with a traceback of its own, which is not ours to silence."""
    run_dir = tmp_path / "run"
    args = [*args_for(run_dir, 100000), "trainer.log_every=1000", "trainer.checkpoint_every=50"]
    proc = start(args, nproc=2)
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000050").is_dir(), proc)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "on SIGINT" in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.count("Interrupted: finishing the step") == 1  # rank 0 says it, for the run
    stopped_at = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert 50 < stopped_at < 100  # the step in progress or the next, not the next one that logs or saves
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert newest.name == f"step_{stopped_at:08d}"
    assert {p.name for p in newest.glob("random_states_*")} == {f"random_states_{rank}.safetensors" for rank in (0, 1)}

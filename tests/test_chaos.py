"""Never lose a run: SIGKILL at many moments (a step, an evaluation, a save, an export), `resume=auto` after each,
and the run ends with the weights and losses of a run never interrupted. The kills and the work each one lost
(optimizer steps logged after the newest checkpoint) are reported at the end of the test session."""

import contextlib
import os
import random
import signal
import time

import pytest
from safetensors.torch import load_file

from src.checkpointing.layout import complete_checkpoints
from tests.conftest import TINY_GPT, exported_weights, max_abs_diff, process_tree, run, scalars, start

# Where a kill lands: the first moment this marker shows, or (None) a random moment of the launch.
MARKERS = {"save": "checkpoints/.tmp-step_*", "export": ".tmp-model*", "best export": ".tmp-model_best", "random": None}


def args_for(run_dir, max_steps: int) -> list[str]:
    return [*TINY_GPT, "model.dropout=0.1", "data.batch_size=4", "trainer.gradient_accumulation_steps=2",
            f"trainer.max_steps={max_steps}", "trainer.log_every=1", "trainer.eval_every=6", "trainer.eval_batches=4",
            "trainer.checkpoint_every=4", "trainer.monitor=eval/loss", f"hydra.run.dir={run_dir}"]


def kill_at(proc, run_dir, marker: str | None, rng: random.Random, timeout: float = 120) -> bool:
    """SIGKILL the whole launch when `marker` appears (or at a random moment); False if it ended first. What an
    earlier kill left behind (a .tmp- directory) counts only once this launch makes it anew."""
    deadline = time.monotonic() + timeout
    left = {path: path.stat().st_mtime_ns for path in run_dir.glob(marker)} if marker else {}
    if marker is None:  # a random moment of the training itself, after this launch's start-up (its banner)
        banners = _banners(run_dir)
        while _banners(run_dir) == banners:
            if proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, "the launch never started training"
            time.sleep(0.01)
        deadline = time.monotonic() + rng.uniform(0, 1.5)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if marker is not None and any(left.get(path) != _mtime(path) for path in run_dir.glob(marker)):
            break
        time.sleep(0.002)
    else:
        if marker is not None:
            raise AssertionError(f"{marker} never appeared")
    for pid in process_tree(proc.pid):  # the launcher and its workers at once, as a node failure would end them
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    return True


def _banners(run_dir) -> int:
    log = run_dir / "train.log"
    return log.read_text().count("deterministic kernels") if log.exists() else 0


def _mtime(path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def chaos(tmp_path, nproc: int, phases: list[str], seed: int, max_steps: int) -> list[dict]:
    reference, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    run(args_for(reference, max_steps), nproc=nproc)
    rng, kills = random.Random(seed), []
    for phase in [*phases, "finish"]:
        proc = start([*args_for(run_dir, max_steps), "resume=auto"], nproc, quiet=True)
        if phase == "finish":
            assert proc.wait(timeout=300) == 0, "the last resume failed"
            break
        if not kill_at(proc, run_dir, MARKERS[phase], rng):
            assert proc.returncode == 0
            break  # the run finished before this kill: nothing left to interrupt
        saved = complete_checkpoints(run_dir)
        logged = max(scalars(run_dir, "train/loss"), default=0) if (run_dir / "tensorboard").exists() else 0
        newest = int(saved[-1].name.split("_")[1]) if saved else 0
        kills.append({"phase": phase, "step reached": logged, "resumes from": newest, "steps lost": logged - newest})
    assert scalars(run_dir, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(run_dir)) == 0
    best = [load_file(directory / "model_best" / "model.safetensors") for directory in (reference, run_dir)]
    assert max_abs_diff(*best) == 0
    assert not list(run_dir.glob("checkpoints/.tmp-*")) and not list(run_dir.glob(".tmp-*"))
    return kills


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
def test_a_run_killed_during_a_save_a_step_and_an_export_ends_as_if_never_killed(tmp_path, record_property):
    kills = chaos(tmp_path, 1, ["save", "random", "export"], seed=1, max_steps=100)
    record_property("chaos", kills)
    assert [k["phase"] for k in kills] == ["save", "random", "export"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_killed_many_times_at_random_moments_ends_as_if_never_killed(tmp_path, record_property, nproc):
    rng = random.Random(nproc)
    phases = [rng.choice(list(MARKERS)) for _ in range(8)]
    kills = chaos(tmp_path, nproc, phases, seed=nproc, max_steps=200)
    record_property("chaos", kills)
    assert len(kills) >= 4


@pytest.mark.slow  # with the other chaos tests
def test_a_kill_during_the_export_of_the_best_model_is_redone_by_the_resume(tmp_path):
    """The only evaluation is the last step's, so nothing later would export the best model again."""
    for attempt in range(3):  # a busy machine can hide the export's few milliseconds from the poll: try again
        kills = chaos(tmp_path / str(attempt), 1, ["best export"], seed=0, max_steps=6)
        if kills:
            break
    assert [(k["phase"], k["resumes from"]) for k in kills] == [("best export", 4)]

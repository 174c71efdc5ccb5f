"""The suite's preloaded launches (tests/preloaded.py) stand for `python train.py`: same weights, same exit
status and message, and a process of their own."""

import subprocess
import sys

import pytest

from tests.conftest import QUIET, ROOT, TINY_GPT, exported_weights, max_abs_diff, run, start, wait_for


def test_a_forked_launch_trains_the_weights_a_fresh_python_does_and_fails_as_it_does(tmp_path):
    args = [*TINY_GPT, *QUIET, "model.dropout=0.1", "trainer.max_steps=3", "trainer.eval_batches=2"]
    forked = run([*args, f"hydra.run.dir={tmp_path / 'forked'}"])
    fresh = subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / 'fresh'}"], cwd=ROOT,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert fresh.returncode == 0, fresh.stdout[-3000:]
    assert max_abs_diff(exported_weights(tmp_path / "forked"), exported_weights(tmp_path / "fresh")) == 0
    assert forked.stdout.count("\n") > 20  # its whole output: banner, progress, summary
    command = [next(line for line in proc.stdout.splitlines() if line.startswith("command ")).split(" hydra.run.dir")[0]
               for proc in (forked, fresh)]
    assert command[0] == command[1]  # argv as typed: train.py ...

    refused = ["trainer.max_epochs=2", "trainer.max_steps=100", f"hydra.run.dir={tmp_path / 'r'}"]
    forked = run(refused, check=False)
    fresh = subprocess.run([sys.executable, "train.py", *refused], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    assert forked.returncode == fresh.returncode != 0
    assert forked.stdout.strip().splitlines()[-1] == fresh.stdout.strip().splitlines()[-1]


def test_a_forked_launch_is_a_process_of_its_own_that_a_signal_ends(tmp_path):
    proc = start([*TINY_GPT, *QUIET, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.poll() is None and proc.pid != 0
    assert subprocess.run(["ps", "-o", "sid=", "-p", str(proc.pid)], capture_output=True, text=True).stdout.strip() \
        == str(proc.pid)  # its own session: a signal to its group reaches it alone
    proc.kill()
    assert proc.wait(timeout=60) == -9


def test_a_forked_launch_that_ends_early_is_seen_ending_by_poll(tmp_path):
    proc = start(["trainer.max_epochs=2", "trainer.max_steps=100", f"hydra.run.dir={tmp_path / 'r'}"])
    with pytest.raises(AssertionError, match="the run ended early"):
        wait_for(lambda: False, proc, timeout=60)
    assert proc.returncode not in (None, 0)

"""The suite's preloaded launches (tests/preloaded.py) stand for `python train.py` and for a launcher's command:
same weights, same exit status and message, processes of their own, and workers that see their launcher."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import (
    QUIET,
    ROOT,
    TINY_GPT,
    banner_row,
    exported_weights,
    failed_launch,
    free_port,
    launchers_root_cause,
    max_abs_diff,
    named,
    run,
    start,
    wait_for,
    worker_pids,
)


@pytest.mark.slow  # the harness's fidelity to a real launch: every default test relies on it
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


@pytest.mark.slow  # the harness's fidelity to a real launch: every default test relies on it
def test_a_forked_two_process_launch_trains_what_the_real_launcher_does_and_its_workers_read_its_flags(tmp_path):
    args = [*TINY_GPT, *QUIET, "model.dropout=0.1", "trainer.max_steps=3", "data.batch_size=4"]
    def launcher() -> list[str]:
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--gradient_accumulation_steps", "2", "--dynamo_backend", "no", "--main_process_port",
                str(free_port()), "train.py"]

    forked = run([*args, f"hydra.run.dir={tmp_path / 'forked'}"], command=launcher())
    fresh = subprocess.run([*launcher(), *args, f"hydra.run.dir={tmp_path / 'fresh'}"], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert fresh.returncode == 0, fresh.stdout[-3000:]
    assert max_abs_diff(exported_weights(tmp_path / "forked"), exported_weights(tmp_path / "fresh")) == 0
    banner = ("processes ", "distributed type ", "device ", "gradient accumulation steps ", "global batch size ")
    lines = [[line for line in proc.stdout.splitlines() if line.startswith(banner)] for proc in (forked, fresh)]
    assert len(lines[0]) == len(banner) and lines[0] == lines[1]
    assert banner_row(forked.stdout, "gradient accumulation steps") == "2 (launcher: --gradient_accumulation_steps)"

    refused = failed_launch(["trainer.max_epochs=2", "trainer.max_steps=100", f"hydra.run.dir={tmp_path / 'r'}"],
                            nproc=2)
    assert refused.returncode == 1  # the launcher's, for a failed worker
    printed = refused.stdout.split("ChildFailedError", 1)[0]  # the workers' own output, before the launcher's
    # Each worker checks; the first to refuse exits at once (os._exit, src/launch/shutdown.py), and the launcher
    # may stop the other before it has printed its own copy.
    assert 1 <= printed.count("trainer.max_epochs=2") <= 2, printed[-3000:]
    named(launchers_root_cause(refused.stdout), "trainer.max_steps=100", "trainer.max_epochs=2",
          "trainer.max_steps=null")


def test_the_workers_of_a_forked_launcher_stop_when_it_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*TINY_GPT, *QUIET, "trainer.max_steps=100000", "trainer.checkpoint_every=5",
                  f"hydra.run.dir={run_dir}"], nproc=2, launcher="torchrun")
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000005").is_dir() and len(worker_pids(proc.pid)) == 2, proc)
    workers = worker_pids(proc.pid)
    assert sorted(workers) == [0, 1]
    proc.kill()
    assert proc.wait(timeout=60) == -9
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in workers.values():
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"worker {pid} trains on without its launcher")
    assert "is gone" in (run_dir / "train.log").read_text()


def test_the_harness_is_one_module_so_gpu_tests_launch_with_the_machines_gpus(request):
    """conftest hides the GPUs from this process at import and keeps the machine's list for the `gpu` tests
    (GPU_ENV); a second import of it would find none to keep, and one preloaded Python per copy would start."""
    import tests.conftest

    hooks = request.config.pluginmanager.get_plugins()
    assert tests.conftest in hooks, "pytest's conftest is not the tests.conftest the test modules import"

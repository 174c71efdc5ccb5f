"""One live run per run directory: a second launch is refused naming the holder; a holder that died is taken over."""

import json
import logging
import os
import signal
import subprocess
import threading
import time

import pytest

from src.errors import RunDirInUse
from src.faults.run_dir_lock import LOCK_FILE, acquire_run_dir, release_run_dirs
from tests.conftest import QUIET, TINY_GPT, named, refused, run, start, wait_for


@pytest.fixture(autouse=True)
def let_go():
    yield
    release_run_dirs()


def holder_file(run_dir, host: str, pid: int, age_s: float = 0.0, job: str | None = None):
    lock = run_dir / LOCK_FILE
    lock.write_text(json.dumps({"host": host, "pid": pid, "since": "2026-11-23T10:00:00", "job": job, "token": "t"}))
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_live_holder_is_refused_by_name_and_released_at_the_end(tmp_path):
    lock = acquire_run_dir(tmp_path, lease_s=60)
    with pytest.raises(RunDirInUse, match=rf"in use by a live run: pid {os.getpid()} on {os.uname().nodename}.*"
                                          r"hydra.run.dir"):
        acquire_run_dir(tmp_path, lease_s=60)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    acquire_run_dir(tmp_path, lease_s=60)


def test_a_holder_whose_process_is_gone_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = dead_pid()
    holder_file(tmp_path, os.uname().nodename, pid)
    with caplog.at_level(logging.WARNING):
        acquire_run_dir(tmp_path, lease_s=60)
    assert f"took over the lock of pid {pid}" in caplog.text and "is gone" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]  # the stale one set aside is removed


def test_a_holder_killed_but_not_yet_reaped_is_taken_over(tmp_path):
    """A SIGKILLed rank 0 whose launcher died with it stays a zombie until init reaps it (seconds, on some
    machines): a resume started meanwhile must not be refused by a process that can never run again."""
    holder = subprocess.Popen(["sleep", "60"])
    try:
        holder_file(tmp_path, os.uname().nodename, holder.pid)
        with pytest.raises(RunDirInUse):
            acquire_run_dir(tmp_path, lease_s=60)
        holder.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{holder.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        acquire_run_dir(tmp_path, lease_s=60)  # not waited for: still a zombie, our child
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_whose_pid_now_names_another_process_is_taken_over(tmp_path, caplog):
    lock = holder_file(tmp_path, os.uname().nodename, os.getpid())
    record = json.loads(lock.read_text())
    lock.write_text(json.dumps({**record, "started": 1}))  # this pid, but a process that started at boot
    with caplog.at_level(logging.WARNING):
        acquire_run_dir(tmp_path, lease_s=60)
    assert "the pid now belongs to another process" in caplog.text


def test_another_hosts_holder_blocks_while_its_heartbeat_is_fresh_and_is_taken_over_after_the_lease(tmp_path):
    holder_file(tmp_path, "node-17", 4242, age_s=5, job="981")
    with pytest.raises(RunDirInUse) as error:
        acquire_run_dir(tmp_path, lease_s=60)
    named(str(error.value), "pid 4242", "node-17", "SLURM job 981", "2026-11-23T10:00:00", "5 s ago")
    holder_file(tmp_path, "node-17", 4242, age_s=61)
    acquire_run_dir(tmp_path, lease_s=60)


def in_a_thread(call) -> tuple[threading.Thread, list]:
    """call() running in a daemon thread, and the list its return value or exception will be put in."""
    outcome = []

    def target():
        try:
            outcome.append(call())
        except Exception as error:  # noqa: BLE001 (the test inspects it)
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_a_fresh_launch_is_refused_without_waiting_for_the_holders_lease(tmp_path):
    holder_file(tmp_path, "node-17", 4242)
    thread, outcome = in_a_thread(lambda: acquire_run_dir(tmp_path, lease_s=3600))
    thread.join(timeout=60)  # waiting for the lease would take an hour
    assert not thread.is_alive() and isinstance(outcome[0], RunDirInUse)


def test_a_requeued_job_waits_for_its_previous_instances_lease_to_run_out_then_takes_over(tmp_path):
    lock = holder_file(tmp_path, "node-17", 4242)  # its last heartbeat just now: alive as far as anyone can tell
    thread, outcome = in_a_thread(lambda: acquire_run_dir(tmp_path, lease_s=2, requeued=True))
    while time.time() - lock.stat().st_mtime < 1.5:  # the heartbeat still fresh: neither refused nor taken over
        assert not outcome, outcome
        time.sleep(0.01)
    thread.join(timeout=60)
    assert not thread.is_alive() and not isinstance(outcome[0], Exception), outcome
    assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_the_holder_touches_its_lock_and_never_removes_another_holders(tmp_path):
    lock = acquire_run_dir(tmp_path, lease_s=0.4)
    path = tmp_path / LOCK_FILE
    os.utime(path, (0, 0))
    deadline = time.monotonic() + 60
    while path.stat().st_mtime == 0:  # until the heartbeat renews it
        assert time.monotonic() < deadline, "the holder never touched its lock"
        time.sleep(0.01)
    holder_file(tmp_path, "node-17", 4242)  # taken over by another launch meanwhile
    lock.release()
    assert json.loads(path.read_text())["host"] == "node-17"


def test_of_launches_racing_for_one_directory_exactly_one_wins(tmp_path):
    for attempt in range(50):
        run_dir = tmp_path / str(attempt)
        run_dir.mkdir()
        holder_file(run_dir, os.uname().nodename, dead_pid())  # both also race for the takeover
        start, outcomes = threading.Barrier(2), []

        def take():
            start.wait()
            try:
                acquire_run_dir(run_dir, lease_s=60)
                outcomes.append("won")
            except RunDirInUse:
                outcomes.append("refused")

        threads = [threading.Thread(target=take) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["refused", "won"]
        release_run_dirs()


def test_a_second_launch_into_a_live_run_is_refused_fresh_or_resuming_and_a_killed_holder_is_resumed(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.checkpoint_every=5", f"hydra.run.dir={run_dir}"]
    holder = start([*args, "trainer.max_steps=100000"], quiet=True)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_00000005").is_dir(), holder)
        config = (run_dir / "config.yaml").read_bytes()
        for extra in (["optimizer.lr=0.1"], ["resume=auto"]):
            refused(run(args + ["trainer.max_steps=10", *extra], check=False), str(holder.pid), os.uname().nodename,
                    "hydra.run.dir")
        assert (run_dir / "config.yaml").read_bytes() == config
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    resumed = run(args + ["resume=auto", "trainer.max_steps=12"])
    assert f"took over the lock of pid {holder.pid}" in resumed.stdout and "is gone" in resumed.stdout
    assert "resumed from" in resumed.stdout
    assert not (run_dir / LOCK_FILE).exists()  # let go at the end

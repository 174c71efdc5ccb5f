"""Distributed failures that are the user's to fix end with one message in our words, naming the key to change."""

import socket

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from src.errors import DistributedFailure, UsageError, told_to_the_launcher
from src.faults.distributed_errors import lost_ranks_in_our_words
from tests.conftest import QUIET, TINY_GPT, failed_launch, launchers_root_cause, named, refused, run


def test_a_multi_process_launch_refused_before_training_ends_with_its_reason_in_the_launchers_table(tmp_path):
    """The launcher's closing table of failed ranks is what a user reads last: it names the mistake, not
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"."""
    failed = failed_launch(["trainer.max_steps=0", f"hydra.run.dir={tmp_path / 'run'}"], nproc=2)
    assert failed.returncode != 0
    root_cause = launchers_root_cause(failed.stdout)
    assert "trainer.max_steps=0" in root_cause and ">= 1" in root_cause, failed.stdout[-4000:]
    assert "To enable traceback see" not in root_cause
    assert not (tmp_path / "run").exists()  # refused before the run dir, as on one process


@pytest.mark.parametrize("error, message", [
    (UsageError("trainer.max_steps=0 is out of range"), "trainer.max_steps=0 is out of range"),
    (ValueError("a bug"), "ValueError: a bug (its traceback is above)"),
])
def test_the_launcher_reads_a_failed_workers_message_from_the_file_it_named(tmp_path, monkeypatch, error, message):
    """What torch's launcher shows in its table (its own parser of the file it gave the worker)."""
    error_file = tmp_path / "attempt_0" / "1" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(type(error)), told_to_the_launcher():
        raise error
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message == message


def test_a_parameter_without_gradient_under_ddp_is_named_with_the_key_that_allows_it(tmp_path):
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.max_steps=3",
            "model._target_=tests.components.WithUnusedHead"]
    failed = failed_launch([*args, f"hydra.run.dir={tmp_path / 'strict'}"], nproc=2)
    assert failed.returncode != 0
    assert "unused_head.weight, unused_head.bias" in failed.stdout, failed.stdout[-4000:]
    assert "trainer.ddp_find_unused_parameters=true" in failed.stdout
    assert "Expected to have finished reduction" not in failed.stdout  # torch's wording, and its find_unused_parameters
    assert "unused_head.weight" in launchers_root_cause(failed.stdout), failed.stdout[-4000:]
    run([*args, "trainer.ddp_find_unused_parameters=true", f"hydra.run.dir={tmp_path / 'allowed'}"], nproc=2)


def test_a_main_port_in_use_is_named_with_the_ways_to_choose_another(tmp_path):
    """An env:// launch (srun tasks, a hand-set MASTER_ADDR/MASTER_PORT): rank 0 is the one that listens."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        failed = run([*TINY_GPT, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], check=False, env=env)
    refused(failed, str(port), "MASTER_PORT=", "--main_process_port", "--master_port")


@pytest.mark.parametrize("gloo_says, why", [
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:64133", "another rank's process ended"),
    ("[pair.cc:446] Timed out waiting 1800000ms for recv operation to complete",
     "another rank stopped answering, and trainer.dist_timeout_s=1800 s passed"),  # the default, not given
])
def test_a_lost_peer_is_told_apart_from_a_silent_one(gloo_says, why):
    with pytest.raises(DistributedFailure) as failure, lost_ranks_in_our_words(None):
        raise RuntimeError(gloo_says)
    named(str(failure.value), gloo_says, why)

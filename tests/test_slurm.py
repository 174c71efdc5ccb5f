"""The SLURM scripts on a real (local, 2-node) SLURM cluster: `scripts/local_slurm.sh start` brings one up."""

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    QUIET,
    ROOT,
    TINY_GPT,
    banner_row,
    exported_weights,
    launch_command,
    max_abs_diff,
    run,
    scalars,
)


def cluster_is_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return result.returncode == 0 and "idle" in result.stdout


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(not cluster_is_up(), reason="no SLURM cluster here (start one: scripts/local_slurm.sh start)"),
]
# The test nodes have 1 CPU and no GPU: override the scripts' #SBATCH hardware lines as a user would.
CPU_NODES = ["--gpus-per-node=0", "--cpus-per-task=1"]
TRAIN = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.monitor=null"]


def submit(script: str, sbatch_args: list[str], overrides: list[str], log: Path) -> str:
    result = subprocess.run(["sbatch", "--parsable", *CPU_NODES, f"--output={log}", *sbatch_args,
                             f"slurm/{script}", *overrides], cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.strip().split(";")[0]


def job_field(job_id: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(f"{field}=")), "")


def wait_for_end(job_id: str, timeout: float, release_requeued: bool = False) -> str:
    """The job's final state. release_requeued: a requeued job waits for a begin time SLURM sets (about 2
    minutes); release it at once, as an admin may."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(job_id, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if state == "PENDING" and release_requeued and job_field(job_id, "Restarts") not in ("", "0"):
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still {job_field(job_id, 'JobState')} after {timeout} s")


def submit_endless_run(run_dir: Path, overrides: list[str], log: Path) -> str:
    """A 2-node job that trains until stopped; returns its id once its first optimizer step is logged (its signal
    handlers are in place by then)."""
    job = submit("train_multi_node.sbatch", [],
                 [*TRAIN, "trainer.max_steps=100000", *overrides, f"hydra.run.dir={run_dir}"], log)
    deadline = time.monotonic() + 120
    while not ((run_dir / "tensorboard").is_dir() and scalars(run_dir, "train/loss")):
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)
    return job


def test_two_node_job_ends_with_the_weights_of_a_single_node_two_process_run(tmp_path):
    """With its main port already taken on the main host: the script picks a free one."""
    overrides = [*TRAIN, "trainer.max_steps=8"]
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = submit("train_multi_node.sbatch", [f"--export=ALL,MAIN_PORT={port}"],
                     [*overrides, f"hydra.run.dir={tmp_path / 'slurm'}"], tmp_path / "log")
        assert wait_for_end(job, 180) == "COMPLETED", (tmp_path / "log").read_text(errors="replace")[-3000:]
    log = (tmp_path / "log").read_text(errors="replace")
    assert "2 nodes x 1 process(es)" in log and "DistributedType.MULTI_CPU" in log
    assert f"port {port} is in use on" in log
    run([*overrides, f"hydra.run.dir={tmp_path / 'local'}"], nproc=2)
    assert max_abs_diff(exported_weights(tmp_path / "slurm"), exported_weights(tmp_path / "local")) == 0


def test_usr1_checkpoints_requeues_and_resumes_in_the_job_id_run_dir_to_the_uninterrupted_weights(tmp_path):
    overrides = [*TRAIN, "model.dropout=0.1", "trainer.max_steps=200", "trainer.checkpoint_every=10"]
    job = submit("train_multi_node.sbatch", [], overrides, tmp_path / "log")  # default run dir: from the job id
    run_dir = ROOT / "outputs" / f"slurm-{job}"
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "step_00000010").is_dir():
            assert time.monotonic() < deadline and job_field(job, "JobState") in ("PENDING", "RUNNING")
            time.sleep(0.1)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        assert wait_for_end(job, 300, release_requeued=True) == "COMPLETED", (tmp_path / "log").read_text(errors="replace")[-3000:]
        log = (tmp_path / "log").read_text(errors="replace")
        assert job_field(job, "Restarts") == "1"
        assert "on SIGUSR1: saving a checkpoint" in log and f"requeued SLURM job {job}" in log
        assert "resumed from" in log
        run([*overrides, f"hydra.run.dir={tmp_path / 'uninterrupted'}"], nproc=2)
        assert scalars(run_dir, "train/loss") == scalars(tmp_path / "uninterrupted", "train/loss")
        assert max_abs_diff(exported_weights(run_dir), exported_weights(tmp_path / "uninterrupted")) == 0
    finally:
        subprocess.run(["scancel", job])
        shutil.rmtree(run_dir, ignore_errors=True)


def test_sigkill_of_one_training_process_fails_the_whole_job_without_hanging(tmp_path):
    run_dir = tmp_path / "run"
    # A collective timeout far beyond the wait below: the job must end because srun stops it, not by timing out.
    job = submit_endless_run(run_dir, ["trainer.dist_timeout_s=600"], tmp_path / "log")
    workers = subprocess.run(["pgrep", "-f", f"train.py .*hydra.run.dir={run_dir}"], capture_output=True, text=True)
    launchers = ("accelerate", "launch_node.sh")  # srun's, the node script's and the launcher's command lines
    training = [int(p) for p in workers.stdout.split()
                if not any(word in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for word in launchers)]
    assert len(training) == 2
    subprocess.run(["kill", "-9", str(training[-1])], check=True)
    assert wait_for_end(job, 120) == "FAILED"


def test_a_submitit_sweep_runs_each_job_on_two_nodes_resumes_a_preempted_job_and_returns_the_metrics(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional: pip install -r requirements-extras.txt")
    import pickle

    # One CPU thread per process on both sides: a job gets its node's cores, the local run shares this machine's,
    # and on some CPUs (AVX2, not AVX-512) the kernels' results differ in the last bit with the thread count.
    overrides = [*TRAIN, "model.dropout=0.1", "trainer.max_steps=100", "trainer.checkpoint_every=10",
                 "trainer.monitor=eval/loss", "trainer.eval_batches=2", "trainer.cpu_threads=1"]
    sweep, output, job = tmp_path / "sweep", tmp_path / "sweep.log", None
    with output.open("w") as out:  # a file, not a pipe: submitit's polling output would fill a pipe's buffer
        sweeper = subprocess.Popen(
            launch_command("train.py", 1) + ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2",
                                             "hydra.launcher.timeout_min=5",
                                             "+hydra.launcher.additional_parameters.requeue=true",
                                             *overrides, "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        # Preempt job 0 mid-run as SLURM would before its time limit (submitit asks for SIGUSR2).
        deadline = time.monotonic() + 120
        while not (sweep / "0" / "checkpoints" / "step_00000010").is_dir():
            assert time.monotonic() < deadline and sweeper.poll() is None, "job 0 never checkpointed"
            time.sleep(0.1)
        (job,) = {p.name.split("_")[0] for p in (sweep / ".submitit").glob("*_0")}
        subprocess.run(["scancel", "--signal=USR2", f"{job}_0"], check=True)
        assert wait_for_end(f"{job}_0", 240, release_requeued=True) == "COMPLETED"
        assert sweeper.wait(timeout=240) == 0, output.read_text()[-3000:]
    finally:
        sweeper.kill()
        if job is not None:
            subprocess.run(["scancel", job])
    assert "on SIGUSR2: saving a checkpoint" in (sweep / "0" / "train.log").read_text()
    assert "#SBATCH --requeue" in next((sweep / ".submitit").glob("*/*_submission.sh")).read_text()
    for number, lr in ((0, "0.001"), (1, "0.003")):
        log = (sweep / str(number) / "train.log").read_text()
        assert banner_row(log, "processes") == "2 (1 per node, 2 node(s))"
        assert banner_row(log, "distributed type") == "DistributedType.MULTI_CPU"
        assert f"  lr: {lr}\n" in (sweep / str(number) / "config.yaml").read_text()
        best = json.loads((sweep / str(number) / "summary.json").read_text())["best"]["value"]
        # What the launcher hands Hydra's sweeper: node 0's return value of train.py's main.
        (result,) = (sweep / ".submitit").glob(f"*_{number}/*_{number}_0_result.pkl")
        status, job_return = pickle.loads(result.read_bytes())
        assert status == "success" and job_return.return_value == best
    # The preempted and resumed job ends with the weights of an uninterrupted 2-process run.
    run([*overrides, "optimizer.lr=1e-3", f"hydra.run.dir={tmp_path / 'local'}"], nproc=2)
    assert scalars(sweep / "0", "train/loss") == scalars(tmp_path / "local", "train/loss")
    assert max_abs_diff(exported_weights(sweep / "0"), exported_weights(tmp_path / "local")) == 0


def test_a_plain_scancel_saves_a_checkpoint_and_is_not_requeued(tmp_path):
    run_dir = tmp_path / "run"
    job = submit_endless_run(run_dir, ["trainer.checkpoint_every=100000"], tmp_path / "log")
    subprocess.run(["scancel", job], check=True)  # SIGTERM to every process of the job
    assert wait_for_end(job, 120) == "CANCELLED"
    log = (tmp_path / "log").read_text(errors="replace")
    assert "on SIGTERM: saving a checkpoint" in log and "not requeued" in log
    assert job_field(job, "Restarts") == "0" and list((run_dir / "checkpoints").glob("step_*"))


def test_optuna_trials_run_as_one_process_slurm_jobs_and_the_best_is_what_they_returned(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional: pip install -r requirements-extras.txt")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="optional: pip install -r requirements-extras.txt")
    import yaml

    sweep = tmp_path / "sweep"
    run(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
         "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=5", *TINY_GPT, *QUIET, "data.batch_size=4",
         "trainer.max_steps=2", "trainer.eval_batches=2", f"hydra.sweep.dir={sweep}"], timeout=240)
    trials = [json.loads((sweep / str(n) / "summary.json").read_text()) for n in (0, 1)]
    assert [trial["processes"] for trial in trials] == [1, 1]  # a 1-node, 1-process job is a plain launch
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == min(trial["best"]["value"] for trial in trials)

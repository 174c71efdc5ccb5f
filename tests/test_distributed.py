"""Real multi-process runs over gloo on CPU: DDP is real, the maths is the same however a batch is split."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from src.checkpointing.plain_state import load_tree
from tests.conftest import (
    QUIET,
    ROOT,
    TINY_GPT,
    banner_row,
    exported_weights,
    free_port,
    launch_command,
    max_abs_diff,
    named,
    run,
    scalars,
    start,
)


def test_two_process_run_is_real_ddp_with_identical_replicas_own_dropout_streams_and_one_set_of_outputs(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([*TINY_GPT, *QUIET, "model.dropout=0.1", "trainer.max_steps=12", "trainer.eval_every=6",
                "data.batch_size=8", f"hydra.run.dir={run_dir}"], nproc=2)
    assert banner_row(proc.stdout, "distributed type") == "DistributedType.MULTI_CPU"
    assert proc.stdout.count("distributed type ") == 1  # the banner is printed once, by rank 0
    assert "(a whole copy on each rank): weights" in proc.stdout  # DDP: the model's state is not sharded
    fingerprints = re.search(r"parameter fingerprint per rank .*: \[(.*)\]", proc.stdout).group(1).split(", ")
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1]
    # The same masks on both ranks would correlate the global batch's samples: each rank's stream is its own.
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    rank_streams = [load_tree(checkpoint / f"random_states_{rank}.safetensors")["torch_manual_seed"] for rank in (0, 1)]
    assert not torch.equal(*rank_streams)
    assert len(list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints", "config.yaml", "model", "model_best", "summary.json", "tensorboard", "train.log"]
    assert [p.name for p in (run_dir / "model").iterdir()].count("model.safetensors") == 1
    assert sorted(scalars(run_dir, "train/loss")) == list(range(1, 13))


def test_global_batch_gives_the_same_weights_and_lr_however_it_is_split(tmp_path):
    """(1 process, batch 2B), (1 process, batch B, accumulation 2) and (2 processes, batch B) agree, the last
    with DDP's settings (static graph, gradients as bucket views, 1 MB buckets) reaching DDP."""
    common = [*TINY_GPT, *QUIET, "trainer.max_steps=6", "trainer.max_grad_norm=0.5", "scheduler.warmup_steps=2",
              "optimizer.lr=1e-2", "trainer.checkpoint_every=0", "trainer.monitor=null"]
    layouts = {
        "one_process_batch_8": (1, ["data.batch_size=8", "trainer.gradient_accumulation_steps=1"]),
        "one_process_batch_4_accumulate_2": (1, ["data.batch_size=4", "trainer.gradient_accumulation_steps=2"]),
        # with every DDP setting changed from its default: they change how gradients travel, not their values
        "two_processes_batch_4": (2, ["data.batch_size=4", "trainer.gradient_accumulation_steps=1",
                                      "trainer.ddp_static_graph=true", "trainer.ddp_gradient_as_bucket_view=true",
                                      "trainer.ddp_bucket_cap_mb=1"]),
    }
    weights, lrs, losses = {}, {}, {}
    for name, (nproc, args) in layouts.items():
        run_dir = tmp_path / name
        run([*common, *args, f"hydra.run.dir={run_dir}"], nproc=nproc)
        weights[name], lrs[name], losses[name] = exported_weights(run_dir), scalars(run_dir, "train/lr"), scalars(run_dir, "train/loss")
    reference = weights.pop("one_process_batch_8")
    for name, w in weights.items():
        assert max_abs_diff(reference, w) <= 1e-5, name
    assert lrs["one_process_batch_8"] == lrs["one_process_batch_4_accumulate_2"] == lrs["two_processes_batch_4"]
    assert len(set(lrs["one_process_batch_8"].values())) > 1  # the schedule really moved
    for name in layouts:
        assert abs(losses[name][1] - losses["one_process_batch_8"][1]) < 1e-5, name  # same first global batch


@pytest.fixture(scope="module")
def trained_resnet(tmp_path_factory, cifar_root):
    run_dir = tmp_path_factory.mktemp("resnet") / "run"
    run(["experiment=cifar10_resnet", f"data.root={cifar_root}", "model.width=8", "data.batch_size=32",
         "data.num_workers=0", "trainer.max_steps=10", *QUIET, f"hydra.run.dir={run_dir}"])
    return run_dir


@pytest.mark.parametrize("bound, samples", [([], 301), (["eval_batches=3", "+data.eval_batch_size=13"], 39)])
def test_eval_metric_is_the_same_on_one_and_two_processes_with_an_odd_validation_set(trained_resnet, tmp_path,
                                                                                    bound, samples):
    reports = {}
    for nproc in (1, 2):
        output = tmp_path / f"metrics_{nproc}.json"
        # batch 64 over 301 samples: the last global batch is uneven, and accelerate pads it on 2 processes.
        # Bounded (trainer.eval_batches' mechanism): the first 3 x 13 samples, 39 over 2 processes is uneven too.
        run([f"path={trained_resnet / 'model'}", "+data.batch_size=64", f"output={output}", *bound],
            script="eval.py", nproc=nproc)
        reports[nproc] = json.loads(output.read_text())
    assert reports[1]["eval/samples"] == reports[2]["eval/samples"] == samples
    assert reports[2]["num_processes"] == 2
    for metric in ("eval/loss", "eval/accuracy"):
        assert abs(reports[1][metric] - reports[2][metric]) < 1e-9, metric


def test_ranks_of_one_launch_agree_on_the_default_timestamped_run_dir(tmp_path):
    """No hydra.run.dir: each rank resolves the timestamp itself, and they must all pick the same one."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tinyshakespeare.txt").write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:40000])
    run([*TINY_GPT, *QUIET, "trainer.max_steps=2", "data.batch_size=4"], cwd=tmp_path,
        command=launch_command(str(ROOT / "train.py"), 2, "torchrun"))
    run_dirs = list((tmp_path / "outputs").iterdir())
    assert len(run_dirs) == 1, run_dirs
    assert (run_dirs[0] / "model" / "model.safetensors").is_file()


def test_ranks_that_resolve_different_run_dirs_are_refused_and_the_same_one_typed_trains(tmp_path):
    """A hydra.run.dir that differs by rank (here by its RANK variable) would split a run: refused, suggesting one
    for every process; typed, that trains."""
    args = [*TINY_GPT, *QUIET, "trainer.max_steps=1", "data.batch_size=4"]
    proc = run([*args, f"hydra.run.dir={tmp_path}/rank_${{oc.env:RANK}}"], nproc=2, check=False)
    assert proc.returncode != 0
    named(proc.stdout, f"{tmp_path}/rank_1", f"{tmp_path}/rank_0", "hydra.run.dir=PATH")
    run([*args, f"hydra.run.dir={tmp_path}/same"], nproc=2)  # the suggestion: the same PATH on every process


def test_bare_num_processes_without_cuda_warns_with_the_command_that_works(tmp_path):
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'bare'}"],
               command=[sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines",
                        "1", "--mixed_precision", "no", "--dynamo_backend", "no", "train.py"])
    named(proc.stdout, "2 processes", "--num_processes", "ONE",
          "accelerate launch --multi_gpu --num_processes 2 train.py")


def test_a_launch_without_a_shared_store_is_refused_a_default_run_dir_and_accepts_the_one_suggested(
        monkeypatch, tmp_path):
    """srun's tasks (no torch elastic agent) cannot agree on a timestamp: they are asked for hydra.run.dir."""
    from src.errors import UsageError
    from src.launch.hydra_hooks import shared_timestamp
    from tests.test_config import compose_train

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(UsageError) as refused:
        shared_timestamp.__wrapped__()
    named(str(refused.value), "hydra.run.dir=PATH")
    assert compose_train([f"hydra.run.dir={tmp_path}"]).hydra.run.dir == str(tmp_path)  # typed: nothing to agree on


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
def test_workers_that_form_no_process_group_stop_with_a_clear_error():
    """The trap the launch check exists for: N workers launched, but an Accelerator without cpu=True on a
    machine without CUDA is N independent rank-0 processes."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA the workers do form a process group")
    script = (
        "from accelerate import Accelerator\n"
        "from src.launch.checks import check_process_count\n"
        "check_process_count(Accelerator(cpu=False))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "--no-python", sys.executable, "-c", script],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
    )
    assert proc.returncode != 0
    assert "formed no process group" in proc.stdout and "--multi_gpu --num_processes 2" in proc.stdout


def test_more_processes_on_a_node_than_gpus_is_refused_naming_the_launches_that_fit():
    from src.errors import LaunchError
    from src.launch.checks import check_gpus_per_node

    for processes, gpus in ((1, 0), (2, 0), (1, 1), (2, 2), (8, 8)):
        check_gpus_per_node(processes, gpus)  # CPU processes, or one GPU each
    with pytest.raises(LaunchError) as refused:
        check_gpus_per_node(2, 1)
    named(str(refused.value), "2 processes", "1 visible GPU", "accelerate launch train.py",
          "CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 train.py")
    with pytest.raises(LaunchError, match="--multi_gpu --num_processes 4 train.py"):
        check_gpus_per_node(8, 4)


def test_gloo_needs_another_interface_only_where_the_host_name_resolves_to_loopback():
    from src.launch.network import interface_towards, resolves_to_loopback

    assert resolves_to_loopback("localhost")
    assert interface_towards("127.0.0.1") is None
    assert not resolves_to_loopback("192.0.2.2") and not resolves_to_loopback("::ffff:192.0.2.2")


def machines_whose_name_resolves_to_loopback():
    """This machine as several: its host name must resolve to a loopback address, as a cluster node's may (Debian's
    127.0.1.1), and it must have a default route for gloo to fall back on."""
    import socket

    from src.launch.network import default_route_interface, resolves_to_loopback

    interface = default_route_interface()
    if not resolves_to_loopback(socket.gethostname()) or interface is None:
        pytest.skip("this machine's host name has a network address, or it has no default route")
    return interface


def unset_gloo_socket_ifname(monkeypatch) -> None:
    """Unset for the test, and unset again after it, whatever choose_gloo_interface sets in between."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")


def test_a_multi_machine_job_whose_host_name_is_loopback_binds_gloo_to_a_reachable_interface(monkeypatch):
    from src.launch.network import choose_gloo_interface, ipv4_address

    interface = machines_whose_name_resolves_to_loopback()
    unset_gloo_socket_ifname(monkeypatch)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the main node as this one sees it: no route tells
    for world, local in (("2", "2"), ("1", "1")):  # one machine: loopback reaches every rank
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert choose_gloo_interface() is None and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert choose_gloo_interface() == interface == os.environ["GLOO_SOCKET_IFNAME"] and ipv4_address(interface)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    assert choose_gloo_interface() is None  # the user's choice stands


def test_a_multi_machine_job_with_no_reachable_interface_leaves_gloo_alone_with_a_warning_naming_the_variable(
        monkeypatch, caplog):
    import src.launch.network as network

    machines_whose_name_resolves_to_loopback()
    unset_gloo_socket_ifname(monkeypatch)
    for name, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(network, "default_route_interface", lambda: None)  # a machine without a default route
    assert network.choose_gloo_interface() is None and "GLOO_SOCKET_IFNAME" not in os.environ
    named(caplog.text, "set GLOO_SOCKET_IFNAME")


def test_two_machines_whose_host_name_is_loopback_train_over_gloo_on_the_routed_interface(tmp_path):
    """Two torchrun agents on this machine stand for two machines, as SLURM's nodes do in tests/test_slurm.py."""
    interface = machines_whose_name_resolves_to_loopback()
    port, args = free_port(), [*TINY_GPT, *QUIET, "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"]
    machines = [start(args, command=[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                     str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                                     str(port), "train.py"], new_session=False) for rank in (0, 1)]
    outputs = [machine.communicate(timeout=300)[0] for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    for output in outputs:  # each machine chose for itself
        named(output, "loopback", f"gloo binds to {interface}")
    assert banner_row(outputs[0], "distributed type") == "DistributedType.MULTI_CPU"
    assert sorted(scalars(tmp_path / "run", "train/loss")) == [1, 2, 3]


SQRT_OVER_TWO_THREADS = """
import hashlib, sys, torch
from accelerate import Accelerator
from src.launch.accelerator import use_cpu_threads
torch.set_num_threads(2)
if sys.argv[1] == "set-up":
    use_cpu_threads(Accelerator(cpu=True), 2)  # what train.py and eval.py do before anything else runs
squares = torch.linspace(1e-4, 3e-3, 2080) ** 2 * 0.01  # AdamW's second moment of a 65 x 32 embedding's gradient
print(hashlib.sha1(squares.sqrt().numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_every_process_computes_the_same_bits_of_a_first_vector_math_op_split_over_two_threads():
    """The first call into MKL's vector math from two threads at once rounds differently in some processes on a
    Xeon (src/launch/accelerator.py, settle_vector_math): AdamW's first sqrt, and two identical runs drifted apart.
    After the set-up every process computes the same bits. Without it, 11 of 60 processes of this script differed
    on the 2-core Xeon VM: 30 processes then show a regression there all but surely (not on every CPU)."""
    digests = {subprocess.run([sys.executable, "-c", SQRT_OVER_TWO_THREADS, "set-up"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip() for _ in range(30)}
    assert len(digests) == 1, digests

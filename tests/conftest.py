"""Shared helpers: real launches of train.py / eval.py as subprocesses, and readers for what they write."""

import contextlib
import getpass
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.preloaded import Launched, PreloadedPython

ROOT = Path(__file__).resolve().parents[1]


def visible_gpus() -> int:
    """The GPUs this machine shows, counted without initialising CUDA in this process (nvidia-smi)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(line.startswith("GPU ") for line in listing.splitlines())
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len(chosen.split(","))) if chosen else count


# The suite specifies the CPU's behaviour (gloo DDP, bitwise comparisons across process counts), so what it
# launches, and torch in this process, see no GPU, whatever the machine has; `gpu` tests hand theirs back.
GPUS = visible_gpus()
GPU_ENV = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(GPUS)))}
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# accelerate's launcher reads $HF_HOME/accelerate/default_config.yaml: the tests must not see the machine's own.
HF_HOME = os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf_home_")  # removed when the session ends
# No test reaches the network: a hub id resolves from that cache alone (src/models/hub.py), as on a compute node.
os.environ["HF_HUB_OFFLINE"] = "1"
# What the launches leave in the temporary directory, which nobody removes (torch's launcher a torchelastic_*
# folder each), goes to a folder of this session, removed when it ends. This process's own temporary files
# (pytest's tmp_path) and the compiler's caches stay where a user's are, so that compiled tests start warm.
tempfile.tempdir = tempfile.gettempdir()
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.tempdir, f"torchinductor_{getpass.getuser()}"))
LAUNCH_TMP = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="launches_tmp_")
# A GPT small enough that a CPU test run takes seconds; dropout off so runs are comparable.
TINY_GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.dropout=0.0"]
# Every step logged; evaluation only at the end, on the first 4 batches (the whole validation set took about a
# third of a tiny run); a test's own trainer.eval_batches, given later, wins.
EVAL_BOUND = "trainer.eval_batches=4"
QUIET = ["trainer.log_every=1", "trainer.eval_every=0", EVAL_BOUND]
# start()'s and run()'s keys for train.py under accelerate's FSDP2 plugin on CPU processes (tests/fsdp_on_cpu.py).
FSDP_ON_CPU = {"script": "tests/fsdp_on_cpu.py", "launcher": "fsdp"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(script: str, nproc: int, launcher: str = "accelerate") -> list[str]:
    if launcher == "fsdp":  # accelerate's FSDP2 plugin, as config/accelerate/fsdp.yaml asks for it (on CPU processes
        # only with script="tests/fsdp_on_cpu.py", which lifts accelerate's GPU check)
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "config/accelerate/fsdp.yaml",
                "--num_processes", str(nproc), "--main_process_port", str(free_port()), script]
    if nproc == 1:
        return [sys.executable, script]
    if launcher == "accelerate_config":  # the CPU-DDP launch config users are pointed to
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "config/accelerate/cpu_ddp.yaml",
                "--num_processes", str(nproc), "--main_process_port", str(free_port()), script]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), script]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
            "--num_machines", "1", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), script]


PRELOADED = PreloadedPython()


# Variables that the preloaded libraries do not read when imported (the tests' own, the trackers', which the
# preloaded Python does not import): a launch that sets only these can still be forked from it.
READ_WHEN_USED = ("AUTOCAST_RECORD", "HOST_READS_", "MLFLOW_", "WANDB_")


def start(args: list[str], nproc: int = 1, launcher: str = "accelerate", new_session: bool = True,
          quiet: bool = False, script: str = "train.py", env: dict | None = None, command: list[str] | None = None,
          cwd: Path = ROOT) -> "subprocess.Popen | Launched":
    """A real launch (from the repo root unless `cwd`) that runs on while the test watches it:
    `launch_command(script, nproc, launcher)` or the `command` given, then `args`; `proc.communicate()` gives its
    output (stdout and stderr merged). The launch (and a launcher's workers) is forked from a Python that has the
    libraries imported (tests/preloaded.py) unless `env` sets what they read at import. In its own session by
    default, so that a signal to its group reaches only it. `quiet`: nobody reads the output (a pipe left unread
    would block a chatty launch)."""
    command = command or launch_command(script, nproc, launcher)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if command[0] == sys.executable and all(key.startswith(READ_WHEN_USED) for key in env or {}):
        return PRELOADED.start(command[1:] + args, cwd, full_env, new_session)
    output = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(command + args, cwd=cwd, text=True, stdout=output, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=new_session)


def run(args: list[str], script: str = "train.py", nproc: int = 1, launcher: str = "accelerate",
        check: bool = True, timeout: int = 300, env: dict | None = None, command: list[str] | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A real launch, to its end (see start), as subprocess.run gives it."""
    proc = start(args, nproc, launcher, new_session=False, script=script, env=env, command=command, cwd=cwd)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}:\n{output[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def refused(proc: subprocess.CompletedProcess, *names: str) -> None:
    """A refusal as a user meets it: exit status 1, no traceback, and each of `names` (the keys, files or values
    it is about, and what it suggests) in what was printed. The sentence around them is free to change."""
    assert proc.returncode == 1, f"exit status {proc.returncode}:\n{proc.stdout[-3000:]}"
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    named(proc.stdout, *names)


def named(text: str, *names: str) -> None:
    """Each of `names` (keys, values, files, what a message suggests) appears in `text`, in any sentence: a test of
    a message pins what it is about, not its wording."""
    missing = [name for name in names if name not in text]
    assert not missing, f"not named: {missing}\n{text[-3000:]}"


def banner_row(output: str, key: str) -> str:
    """The value of one row of the launch banner (src/launch/banner.py) in a run's output, whatever its column
    width."""
    match = re.search(rf"^{re.escape(key)} +: (.*)$", output, re.MULTILINE)
    assert match, f"no banner row {key!r}:\n{output[-3000:]}"
    return match.group(1)


def failed_launch(args: list[str], nproc: int, **launch) -> subprocess.CompletedProcess:
    """A launch expected to fail, for its launcher's closing table: run once more, into `hydra.run.dir`-again, where
    torch's elastic agent itself crashed while stopping the ranks (os.killpg on a process group already gone: a
    ProcessLookupError in its teardown, before the table: a race in torch 2.13, seen in CI)."""
    failed = run(args, nproc=nproc, check=False, **launch)
    if "Root Cause (first observed failure)" not in failed.stdout and "ProcessLookupError" in failed.stdout:
        again = [f"{arg}-again" if arg.startswith("hydra.run.dir=") else arg for arg in args]
        failed = run(again, nproc=nproc, check=False, **launch)
    return failed


def launchers_root_cause(output: str) -> str:
    """The end of the table of failed ranks that torchrun and `accelerate launch` print last."""
    assert "Root Cause (first observed failure)" in output, output[-4000:]
    return output.rsplit("Root Cause (first observed failure)", 1)[1]


def wait_for(condition, proc, timeout: float = 120) -> None:
    """Until condition() holds, while the launch `proc` runs (an assertion error if it ends first)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def kill_when(args: list[str], nproc: int, ready, timeout: float = 120, **launch) -> None:
    """Start a real launch (`launch`: start's script, launcher...) and SIGKILL the launcher and every process
    under it the moment `ready()` holds, as a node failure would (torch's elastic agent starts each worker in
    its own session, so killing the launcher's process group alone would leave the workers running)."""
    proc = start(args, nproc, quiet=True, **launch)
    try:
        wait_for(ready, proc, timeout)
    finally:
        for pid in process_tree(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def children() -> dict[int, list[int]]:
    """parent pid -> its children's pids, from /proc."""
    found: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            found.setdefault(parent, []).append(int(stat.parent.name))
    return found


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, from /proc (SIGSTOPped first, so none can start another meanwhile)."""
    below, tree, todo = children(), [], [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        tree.append(pid)
        todo += below.get(pid, [])
    return tree


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the training processes a launcher started (its children, or a preloaded launcher's
    zygote's: tests/preloaded_server.py)."""
    below, ranks = children(), {}
    todo = list(below.get(launcher_pid, []))
    while todo:
        pid = todo.pop()
        todo += below.get(pid, [])
        with contextlib.suppress(OSError, StopIteration):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks[int(next(e.split(b"=")[1] for e in env if e.startswith(b"RANK=")))] = pid
    return ranks


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def copy_of_repo(dest: Path) -> Path:
    """The repository's tracked files, modes kept, in `dest`: commands from the README run there as a user
    would, and what they write stays out of this checkout."""
    for name in tracked_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def user_env() -> dict:
    """A user's shell with this virtualenv activated: `accelerate`, `torchrun` and `python` are its own."""
    return {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}


def shell(command: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """A command line as a user types it (stdout and stderr merged)."""
    return subprocess.run(command, shell=True, cwd=cwd, env=user_env(), text=True, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def scalar_events(run_dir: Path):
    """The run's scalars as TensorBoard shows them: all event files of its log dir, read in order, with the purge
    a resumed run requests applied (an EventAccumulator: .Tags()["scalars"], .Scalars(tag))."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """step -> value for one scalar tag (scalar_events). Fails on a duplicated step."""
    acc = scalar_events(run_dir)
    if tag not in acc.Tags()["scalars"]:
        return {}
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"duplicated steps for {tag}: {steps}"
    return {e.step: e.value for e in events}


def texts(run_dir: Path, tag: str) -> dict[int, str]:
    """step -> the text a run logged to TensorBoard under `tag` (its text tab)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    name = f"{tag}/text_summary"
    if name not in acc.Tags()["tensors"]:
        return {}
    return {e.step: make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors(name)}


def short_pairs(path: Path) -> Path:
    """The shipped preference pairs cut short and unequal (each prompt to its last 12 characters, the answers to the
    first 4, 16 or 28 after the speaker's name, pair by pair), so that a batch's answers fit several to a block and
    packing them (data.packing=true) has rows to fill. Pairs whose answers are cut to the same text are left out:
    their reward margin is zero but for rounding, so which answer wins (rewards/accuracies) would be rounding's."""
    rows = [json.loads(line) for line in (ROOT / "data" / "shakespeare_pairs.jsonl").read_text().splitlines()]
    cut = [{"prompt": row["prompt"][-12:], **{answer: row[answer].split("\n", 1)[-1][:4 + 12 * (i % 3)]
                                              for answer in ("chosen", "rejected")}} for i, row in enumerate(rows)]
    path.write_text("".join(json.dumps(row) + "\n" for row in cut if row["chosen"] != row["rejected"]))
    return path


def snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under a directory with its mtime and digest: equal before and after, nothing was written."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def exported_weights(run_dir: Path) -> dict:
    return load_file(run_dir / "model" / "model.safetensors")


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


PRETRAINED_VOCAB = 320


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """A small GPT-2 with a BPE tokenizer of its own, pretrained briefly on tiny Shakespeare by the README's
    scripts/make_tiny_pretrained.py: its loss is far below that of random weights, which is how a run shows it
    started from it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_pretrained", ROOT / "scripts" / "make_tiny_pretrained.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = tmp_path_factory.mktemp("pretrained") / "gpt2_tiny"
    script.make_tiny_pretrained(folder, ROOT / "data" / "tinyshakespeare.txt", steps=100, vocab_size=PRETRAINED_VOCAB,
                                positions=64, n_embd=32, chat_template=False)  # the tests give it theirs
    return folder


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    """A small CIFAR-10-format dataset (odd-sized test split) written by the repo's own script."""
    root = tmp_path_factory.mktemp("cifar")
    subprocess.run([sys.executable, "scripts/make_synthetic_cifar10.py", str(root), "--train-per-batch", "200",
                    "--test", "301"], cwd=ROOT, check=True, capture_output=True)
    return root


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only where CUDA is (the default suite hides GPUs from everything else it launches)."""
    if not GPUS:
        no_gpu = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(no_gpu)


def pytest_sessionfinish(session):
    PRELOADED.close()
    shutil.rmtree(HF_HOME, ignore_errors=True)
    shutil.rmtree(LAUNCH_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """The chaos tests' account: each kill's moment and the optimizer steps it cost."""
    for report in terminalreporter.getreports("passed"):
        for name, kills in report.user_properties:
            if name == "chaos":
                terminalreporter.write_line(f"{report.nodeid}: {len(kills)} kills")
                for kill in kills:
                    terminalreporter.write_line("  " + ", ".join(f"{k} {v}" for k, v in kill.items()))


def put_in_hub_cache(folder: Path, hf_home: Path, repo_id: str, repo_type: str = "model",
                     commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The folder as `hf download REPO_ID` leaves it in the Hugging Face cache: content-addressed blobs, a
    snapshot of links to them named by the commit, and the ref `main` pointing at that commit."""
    repo = hf_home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for part in (repo / "blobs", repo / "refs", snapshot):
        part.mkdir(parents=True, exist_ok=True)
    for file in sorted(path for path in folder.rglob("*") if path.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """This process's Hugging Face cache (tmp_path/hf_home/hub), empty until a test fills it, with the hub out of
    reach, as on a compute node without a network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf_home" / "hub"

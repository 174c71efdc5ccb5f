"""Is the template as fast and as exact as the alternatives? Six benchmarks; results in scripts/BENCHMARKS.md.

    python scripts/benchmark.py parity [--processes 1 2] [overrides...]   # vs a hand-written loop
    python scripts/benchmark.py nanogpt --nanogpt DIR                     # vs karpathy/nanoGPT, same recipe
    python scripts/benchmark.py startup                                   # time to the first optimizer step
    python scripts/benchmark.py checkpoint                                # save MB/s vs a raw write
    python scripts/benchmark.py gpu --nanogpt DIR                         # one GPU: GPT-2-124M vs nanoGPT
    python scripts/benchmark.py stop-vote                                 # the per-step stop vote's cost
    python scripts/benchmark.py parity --device cuda --mixed-precision bf16 --peak-tflops 989 \
        model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=1024 data.batch_size=16

parity: a real `train.py` run (through `accelerate launch`) against a plain PyTorch loop (through `torchrun`
on more than one process) that makes exactly the template's arithmetic, written out: the seedable sampler's
order (a permutation seeded by seed + epoch), whole global batches per epoch, micro-batch k of rank r holding
batch (s*K + k)*P + r, the loss summed and divided by the global batch's target count, DDP with no_sync on
all but the last micro-step, clipping, AdamW, the LR schedule. So the final weights must be bitwise equal,
and the step-time ratio is the template's overhead alone. Both sides run in fresh processes, alternating;
step time is measured between the first and the last logged step (start-up excluded); medians are compared.
With --cpu-time, also the CPU time and minor page faults per step of all of a side's processes (a shorter run
of each cancels start-up): whether a gap is work or waiting, and whether the allocator returns memory each step.
"""

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path
from statistics import mean, median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A benchmark step that must succeed: on failure, its own error output, not only an exit code."""
    done = subprocess.run(cmd, cwd=kwargs.pop("cwd", ROOT), capture_output=True, text=True, **kwargs)
    if done.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import src.schema.hydra_hooks  # noqa: F401  (registers train_base, which config/train.yaml starts from)
    from src.schema.complete import complete_config

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base="1.3"):
        return complete_config(compose(config_name="train", overrides=overrides))


def in_turn(repeat: int, *sides) -> None:
    """Run each side once, in order on even repeats and in reverse on odd ones: no side always gets the machine
    as the other left it (warmer caches, a calmer neighbour)."""
    for side in sides if repeat % 2 == 0 else reversed(sides):
        side()


def scalars(run_dir: Path, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)


# ---------------------------------------------------------------------------------------------- parity


def hand_written(args) -> None:
    """The loop an engineer would write by hand for the template's maths; rank 0 prints a JSON line."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from src.optim.optimizers import build_optimizer
    from src.schema.build import build
    from src.schema.data_sizes import resolve_data_sizes

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = compose_config(args.overrides)
    seed, trainer = cfg.trainer.seed, cfg.trainer
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)  # what accelerate's set_seed does
    if device.type == "cpu":  # the template's share of the cores per process
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    else:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(trainer.tf32)
    data = build(cfg.data, group="data")
    cfg = resolve_data_sizes(cfg, data.sizes())
    model = build(cfg.model, group="model").to(device)
    ddp = DistributedDataParallel(model) if world > 1 else model
    B, K = cfg.data.batch_size, trainer.gradient_accumulation_steps or 1  # null: the launcher default, 1
    optimizer = build_optimizer(cfg.optimizer, model, B * K * world)
    scheduler = build(cfg.scheduler, optimizer, group="scheduler")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)

    def micro_step_loss(x, y):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = ddp(x)
        return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum")

    if trainer.compile:  # the model and its loss as one graph, as the template compiles them
        micro_step_loss = torch.compile(micro_step_loss, mode=trainer.compile_mode)
    torch.manual_seed(seed + 1_000_003 + rank)  # each rank its own dropout stream, as the template seeds it
    dataset = data.train
    epoch_steps = len(dataset) // (B * K * world)  # whole global batches per epoch
    times, tokens_per_step = [], 0
    for step in range(trainer.max_steps):
        epoch, s = divmod(step, epoch_steps)
        if s == 0:
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        window = []
        for k in range(K):
            first = ((s * K + k) * world + rank) * B
            samples = [dataset[i] for i in order[first : first + B]]
            window.append([torch.stack(parts).to(device, non_blocking=True) for parts in zip(*samples)])
        count = torch.tensor(float(sum(y.numel() for _, y in window)), device=device)
        if world > 1:
            dist.all_reduce(count)
        step_loss = torch.zeros((), device=device)
        for k, (x, y) in enumerate(window):
            with ddp.no_sync() if world > 1 and k < K - 1 else contextlib.nullcontext():
                loss_sum = micro_step_loss(x, y)
                scaler.scale(loss_sum * (K * world) / count / K).backward()
                step_loss += loss_sum.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.max_grad_norm or float("inf"))
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if scaler.get_scale() >= scale:  # a step fp16's scaler skipped leaves the schedule where it was
            scheduler.step()
        tokens_per_step = int(count.item()) if not tokens_per_step else tokens_per_step
        if (step + 1) % trainer.log_every == 0:  # the host sync the template makes to log the loss
            if world > 1:
                dist.all_reduce(step_loss)
            (step_loss / count).item()
            times.append(time.perf_counter())
    if rank == 0:
        torch.save(model.state_dict(), args.weights)
        result = {"step_time_s": (times[-1] - times[0]) / (trainer.log_every * (len(times) - 1)),
                  "tokens_per_step": tokens_per_step, "peak_memory_gib": peak_memory_gib(device)}
        print(json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()


def peak_memory_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_hand_written(args, processes: int, weights: Path, steps: int) -> dict:
    launcher = ([sys.executable] if processes == 1 else
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                 f"--master_port={free_port()}"])
    cmd = [*launcher, __file__, "_hand_written", f"--weights={weights}", f"--device={args.device}",
           f"--mixed-precision={args.mixed_precision}", *args.overrides, f"trainer.max_steps={steps}"]
    out = run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_template(args, processes: int, run_dir: Path, steps: int) -> dict:
    launcher = ["accelerate", "launch"] + (["--multi_gpu", f"--num_processes={processes}",
                                           f"--main_process_port={free_port()}"] if processes > 1 else [])
    cmd = [*launcher, "train.py", *args.overrides, f"trainer.max_steps={steps}", "trainer.eval_every=0",
           "trainer.checkpoint_every=0", "trainer.monitor=null", f"trainer.mixed_precision={args.mixed_precision}",
           f"hydra.run.dir={run_dir}"]
    run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    events = scalars(run_dir, "train/loss")
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = summary["peak_memory_gib"]
    return {"step_time_s": (events[-1].wall_time - events[0].wall_time) / (events[-1].step - events[0].step),
            "peak_memory_gib": memory.get("cuda", memory["rss_max_over_ranks"])}


def weights_equal(template_model: Path, hand_weights: Path) -> bool:
    import torch

    from src.checkpointing.export import load_exported_model

    ours, theirs = load_exported_model(template_model).state_dict(), torch.load(hand_weights)
    return ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)


def children_usage() -> tuple[float, int]:
    """CPU seconds (user + system) and minor page faults of every finished child process and its descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def with_cpu_per_step(args, side, steps: int, short_steps: int, short_dir, run_dir) -> dict:
    """A side's run, plus (with --cpu-time) the CPU time and page faults of all its processes per step: a run of
    `steps` minus one of `short_steps`, so that start-up and exit cancel."""
    if not args.cpu_time:
        return side(steps, run_dir)
    before = children_usage()
    side(short_steps, short_dir)
    middle = children_usage()
    result = side(steps, run_dir)
    after = children_usage()
    extra = steps - short_steps
    result["cpu_ms_per_step"] = ((after[0] - middle[0]) - (middle[0] - before[0])) / extra * 1e3
    result["page_faults_per_step"] = ((after[1] - middle[1]) - (middle[1] - before[1])) / extra
    return result


def parity(args) -> dict:
    fixed = [f"trainer.log_every={args.log_every}"]
    args.overrides = [*fixed, *args.overrides]
    cfg = compose_config([f"trainer.max_steps={args.steps}", *args.overrides])
    short_steps = 2 * args.log_every  # the template times steps between logs: a short run needs two
    if args.cpu_time and args.steps <= short_steps:
        sys.exit(f"--cpu-time needs --steps above 2 x --log-every ({short_steps})")

    def template(processes: int):
        return lambda steps, run_dir: run_template(args, processes, run_dir, steps)

    def hand(processes: int):
        return lambda steps, weights: run_hand_written(args, processes, weights, steps)

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for processes in args.processes:
            runs = {"template": [], "hand_written": []}
            equal = True
            for repeat in range(args.repeats):
                run_dir, weights = Path(tmp) / f"p{processes}-{repeat}", Path(tmp) / f"hand-p{processes}-{repeat}.pt"
                short_dir, short_weights = Path(tmp) / f"short-p{processes}-{repeat}", Path(tmp) / "short.pt"
                in_turn(repeat, lambda: runs["template"].append(
                            with_cpu_per_step(args, template(processes), args.steps, short_steps, short_dir, run_dir)),
                        lambda: runs["hand_written"].append(
                            with_cpu_per_step(args, hand(processes), args.steps, short_steps, short_weights, weights)))
                equal &= weights_equal(run_dir / "model", weights)
                ours, theirs = runs["template"][-1], runs["hand_written"][-1]
                cpu = (f" (CPU {ours['cpu_ms_per_step']:.1f} against {theirs['cpu_ms_per_step']:.1f} ms/step)"
                       if args.cpu_time else "")
                print(f"{processes} process(es), run {repeat + 1}: template {ours['step_time_s']*1e3:.1f}"
                      f" ms/step, hand-written {theirs['step_time_s']*1e3:.1f} ms/step{cpu}, weights "
                      f"equal so far: {equal}", file=sys.stderr, flush=True)
            ours = median(r["step_time_s"] for r in runs["template"])
            theirs = median(r["step_time_s"] for r in runs["hand_written"])
            tokens = runs["hand_written"][0]["tokens_per_step"]
            report[str(processes)] = {
                "weights_equal": equal,
                "step_time_ratio": round(ours / theirs, 3),
                "template_ms_per_step_runs": [round(r["step_time_s"] * 1e3, 1) for r in runs["template"]],
                "hand_written_ms_per_step_runs": [round(r["step_time_s"] * 1e3, 1) for r in runs["hand_written"]],
                "template_tokens_per_s": round(tokens / ours),
                "hand_written_tokens_per_s": round(tokens / theirs),
                "template_peak_memory_gib": round(max(r["peak_memory_gib"] for r in runs["template"]), 3),
                "hand_written_peak_memory_gib": round(max(r["peak_memory_gib"] for r in runs["hand_written"]), 3),
            }
            if args.cpu_time:
                for key in ("cpu_ms_per_step", "page_faults_per_step"):
                    for side, side_runs in runs.items():
                        report[str(processes)][f"{side}_{key}_runs"] = [round(r[key], 1) for r in side_runs]
                report[str(processes)]["cpu_time_ratio"] = round(
                    median(r["cpu_ms_per_step"] for r in runs["template"]) /
                    median(r["cpu_ms_per_step"] for r in runs["hand_written"]), 3)
            if args.peak_tflops:
                from src.reporting.telemetry import flops_per_token
                from src.schema.build import build
                from src.schema.data_sizes import resolve_data_sizes

                data = build(cfg.data, group="data")
                model = build(resolve_data_sizes(cfg, data.sizes()).model, group="model")
                flops = flops_per_token(model)
                for side, step_time in (("template", ours), ("hand_written", theirs)):
                    report[str(processes)][f"{side}_mfu"] = round(
                        flops * tokens / step_time / (args.peak_tflops * 1e12 * processes), 4)
    return report


# --------------------------------------------------------------------------------------------- nanoGPT


NANOGPT_RECIPE = [  # nanoGPT's README recipe for a CPU: its flags, with our experiment mirroring them
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
    "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True",
]


def full_validation_loss(model, val) -> float:
    """Mean next-token cross-entropy over every non-overlapping window of the validation split (the template's
    val set), for any model mapping ids to logits: the same measure for both sides."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(val), 64):
            x, y = (torch.stack(parts) for parts in zip(*(val[i] for i in range(first, min(first + 64, len(val))))))
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count


def nanogpt_full_validation(nanogpt: Path, checkpoint: Path, val) -> float:
    import torch

    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model.py

    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count; stdout is the report
        model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    model.eval()
    # nanoGPT's forward returns logits for the last position only unless given targets: ask for all.
    return full_validation_loss(lambda x: model(x, torch.zeros_like(x))[0], val)


def nanogpt(args) -> dict:
    import torch

    from src.checkpointing.export import load_exported_model
    from src.schema.build import build

    nanogpt_dir = Path(args.nanogpt).resolve()
    cfg = compose_config(["experiment=nanogpt_shakespeare_char"])
    val = build(cfg.data, group="data").val
    report = {"template": [], "nanogpt": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "nanoGPT"
        shutil.copytree(nanogpt_dir, work, ignore=shutil.ignore_patterns(".git", "out-*"))
        data_dir = work / "data" / "shakespeare_char"
        shutil.copy(ROOT / "data" / "tinyshakespeare.txt", data_dir / "input.txt")  # no download: same text
        stub = Path(tmp) / "stub"  # prepare.py imports requests only to download input.txt, present here
        stub.mkdir()
        (stub / "requests.py").write_text("")
        run([sys.executable, "prepare.py"], cwd=data_dir, env={**os.environ, "PYTHONPATH": str(stub)})

        def template_run(repeat: int, seed: int) -> None:
            run_dir = Path(tmp) / f"template-{repeat}"
            started = time.time()
            # One process, as nanoGPT runs: the README's `python train.py`, without the launcher's own start-up.
            run([sys.executable, "train.py", "experiment=nanogpt_shakespeare_char", f"trainer.seed={seed}",
                 *args.overrides, f"hydra.run.dir={run_dir}"], env={**os.environ, "TQDM_DISABLE": "1"})
            wall = time.time() - started
            loss = full_validation_loss(load_exported_model(run_dir / "model"), val)
            summary = json.loads((run_dir / "summary.json").read_text())
            report["template"].append({"seed": seed, "wall_s": round(wall, 1), "full_val_loss": round(loss, 4),
                                       "ms_per_step": round(1e3 * median(
                                           e.value for e in scalars(run_dir, "train/step_time")), 1),
                                       "in_run_val_loss": round(summary["final_metrics"]["eval/loss"], 4)})

        def nanogpt_run(repeat: int, seed: int) -> None:
            out = work / f"out-{repeat}"
            started = time.time()
            # nanoGPT has no seed flag: its one torch.manual_seed(1337 + rank) call gets the seed's offset.
            seeded = (f"import runpy, sys, torch; f = torch.manual_seed; torch.manual_seed = lambda s: f(s + {seed - 1337})"
                      "; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')")
            log = run([sys.executable, "-c", seeded, *NANOGPT_RECIPE, f"--out_dir={out}"], cwd=work).stdout
            wall = time.time() - started
            step_ms = [float(line.split("time ")[1].split("ms")[0]) for line in log.splitlines()
                       if line.startswith("iter ") and "time " in line]
            estimate = [line for line in log.splitlines() if line.startswith("step 2000:")]
            report["nanogpt"].append({"seed": seed, "wall_s": round(wall, 1),
                                      "full_val_loss": round(nanogpt_full_validation(work, out / "ckpt.pt", val), 4),
                                      "ms_per_step": round(median(step_ms[1:]), 1),
                                      "its_estimate_at_2000": estimate[0] if estimate else None})

        for repeat, seed in enumerate(seed for seed in args.seeds for _ in range(args.repeats)):
            in_turn(repeat, lambda: template_run(repeat, seed), lambda: nanogpt_run(repeat, seed))
            print(json.dumps({k: v[-1] for k, v in report.items()}), file=sys.stderr, flush=True)
    del torch
    for side in ("template", "nanogpt"):
        report[f"{side}_mean"] = {key: round(mean(r[key] for r in report[side]), 4) for key in ("wall_s", "full_val_loss")}
    report["wall_ratio"] = round(report["template_mean"]["wall_s"] / report["nanogpt_mean"]["wall_s"], 3)
    return report


# --------------------------------------------------------------------------------------------- start-up


def startup(args) -> dict:
    """Seconds from starting a command to its first optimizer step, against importing torch and accelerate."""

    def wall(cmd: list[str]) -> float:
        started = time.time()
        run(cmd)
        return time.time() - started

    def first_step(launcher: list[str]) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.time()
            run([*launcher, "train.py", "trainer.max_steps=1", "trainer.log_every=1", *args.overrides,
                 f"hydra.run.dir={tmp}/r"], env={**os.environ, "TQDM_DISABLE": "1"})
            whole = time.time() - started
            return scalars(Path(tmp) / "r", "train/loss")[0].wall_time - started, whole

    # Any PyTorch training script also pays torch's lazy import of torch._dynamo when it builds an optimizer.
    optimizer = "import torch, accelerate; torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())"
    runs = {"import torch, accelerate": [], "... and build an AdamW": [], "python train.py: first step": [],
            "python train.py: whole": [], "accelerate launch train.py: first step": [],
            "accelerate launch train.py: whole": []}
    for _ in range(args.repeats):
        runs["import torch, accelerate"].append(wall([sys.executable, "-c", "import torch, accelerate"]))
        runs["... and build an AdamW"].append(wall([sys.executable, "-c", optimizer]))
        for name, launcher in (("python train.py", [sys.executable]), ("accelerate launch train.py",
                                                                       ["accelerate", "launch"])):
            first, whole = first_step(launcher)
            runs[f"{name}: first step"].append(first)
            runs[f"{name}: whole"].append(whole)
    base = median(runs["import torch, accelerate"])
    report = {name: {"median_s": round(median(v), 2), "x_import": round(median(v) / base, 2),
                     "runs_s": [round(x, 2) for x in v]} for name, v in runs.items()}
    report["import_profile"] = import_profile()
    return report


def import_profile(top: int = 12) -> list:
    """Where `python train.py`'s imports go: `-X importtime`, cumulative seconds per top-level package."""
    with tempfile.TemporaryDirectory() as tmp:
        out = run([sys.executable, "-X", "importtime", "train.py", "trainer.max_steps=1",
                   f"hydra.run.dir={tmp}/r"], env={**os.environ, "TQDM_DISABLE": "1"}).stderr
    packages: dict[str, float] = {}
    for line in out.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        _, cumulative, name = line.removeprefix("import time:").split("|")
        if not name.startswith("  "):  # one space: an import made at the top level, not inside another one's
            name = name.strip()  # a later, lazy import of a submodule (torch._dynamo) keeps its own name
            packages[name] = packages.get(name, 0.0) + int(cumulative) / 1e6
    return sorted(([name, round(s, 2)] for name, s in packages.items()), key=lambda p: -p[1])[:top]


# ------------------------------------------------------------------------------------------- checkpoint


def checkpoint(args) -> dict:
    """The template's atomic save (accelerate.save_state, metadata, fsync, rename) of a model and its AdamW
    state, against writing the same bytes to the same disk with open/write/fsync."""
    import torch
    from accelerate import Accelerator

    from src.checkpointing.layout import step_dir_name
    from src.checkpointing.checkpointer import Checkpointer
    from src.loop.train_state import TrainState
    from src.optim.optimizers import build_optimizer
    from src.schema.build import build
    from src.schema.data_sizes import resolve_data_sizes

    cfg = compose_config([f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", "model.n_head=8"])
    accelerator = Accelerator(cpu=True)
    data = build(cfg.data, group="data")
    cfg = resolve_data_sizes(cfg, data.sizes())
    model = build(cfg.model, group="model")
    optimizer = build_optimizer(cfg.optimizer, model, global_batch=32)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # so the optimizer has its moments to save
    model, optimizer = accelerator.prepare(model, optimizer)
    times = {"template": [], "raw": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        checkpointer = Checkpointer(accelerator, Path(tmp), cfg, model, data_fingerprint=data.fingerprint())
        first = checkpointer.save(TrainState(step=0))  # a warm-up, and the bytes the raw side writes
        files = {f.relative_to(first): f.read_bytes() for f in first.rglob("*") if f.is_file()}

        def template_save(step: int) -> None:
            checkpointer.save(TrainState(step=step))

        def raw_write(step: int) -> None:
            target = Path(tmp) / f"raw-{step}"
            for name, content in files.items():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                with open(target / name, "wb") as f:
                    f.write(content)
                    f.flush()
                    os.fsync(f.fileno())

        for step in range(1, args.repeats + 1):
            sides = [("template", template_save), ("raw", raw_write)]
            for side, write in sides if step % 2 else sides[::-1]:  # alternating which goes first
                os.sync()  # neither side pays for the other's write-back
                started = time.perf_counter()
                write(step)
                times[side].append(time.perf_counter() - started)
            shutil.rmtree(Path(tmp) / f"raw-{step}")
        assert step_dir_name(args.repeats) in os.listdir(Path(tmp) / "checkpoints")
    size = sum(len(b) for b in files.values())
    ours, raw = times["template"], times["raw"]
    mb = size / 2**20
    return {"checkpoint_mb": round(mb, 1), "template_mb_per_s": round(mb / median(ours), 1),
            "raw_write_mb_per_s": round(mb / median(raw), 1), "ratio": round(median(raw) / median(ours), 3),
            "template_s_runs": [round(t, 3) for t in ours], "raw_s_runs": [round(t, 3) for t in raw]}


# ------------------------------------------------------------------------------------------------- GPU


GPT2_SHAPE = "12,12,768,1024"  # n_layer, n_head, n_embd, block_size: GPT-2-124M
GPU_WARMUP_STEPS = 20  # compilation and allocator warm-up: steps before this are not timed
NANOGPT_WITH_PEAK_MEMORY = (  # nanoGPT's train.py as it is, then its peak memory (CUDA, else RSS) on one line
    "import resource, runpy, sys, torch; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__'); "
    "print('PEAK_MEMORY_GIB', torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else "
    "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)")


def model_shape(args) -> list[str]:
    n_layer, n_head, n_embd, block_size = args.model_shape.split(",")
    return [f"model.n_layer={n_layer}", f"model.n_head={n_head}", f"model.n_embd={n_embd}",
            f"model.block_size={block_size}"]


def nanogpt_shape(args) -> list[str]:
    n_layer, n_head, n_embd, block_size = args.model_shape.split(",")
    return [f"--n_layer={n_layer}", f"--n_head={n_head}", f"--n_embd={n_embd}", f"--block_size={block_size}"]


def timed_lines(cmd: list[str], cwd: Path, env: dict) -> list[tuple[float, str]]:
    """Run a command, stamping each line of its output with the time it arrived (nanoGPT prints no times)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines = [(time.perf_counter(), line.rstrip("\n")) for line in proc.stdout]
    if proc.wait():
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n" + "\n".join(l for _, l in lines[-60:]))
    return lines


def per_step(stamps: list[tuple[int, float]]) -> float:
    """Seconds per optimizer step between the first logged step after the warm-up and the last one."""
    timed = [(step, t) for step, t in stamps if step >= GPU_WARMUP_STEPS]
    (first, t0), (last, t1) = timed[0], timed[-1]
    return (t1 - t0) / (last - first)


def compile_overrides(args, compiled: bool) -> list[str]:
    """nanoGPT compiles in torch.compile's default mode; --compile-mode tries another for the template only."""
    if not compiled:
        return ["trainer.compile=false"]
    return ["trainer.compile=true", f"trainer.compile_mode={args.compile_mode}"]


def gpu_template(args, batch: int, accumulation: int, compiled: bool, run_dir: Path, bin_file: Path) -> dict:
    cmd = [sys.executable, "train.py", "experiment=owt_tokens", *model_shape(args), f"data.path={bin_file}",
           "data.vocab_size=50304", "data.val_fraction=0.05", f"data.batch_size={batch}",
           f"trainer.gradient_accumulation_steps={accumulation}", *compile_overrides(args, compiled),
           f"trainer.max_steps={args.steps}", "trainer.log_every=10", "trainer.eval_every=0", "trainer.eval_batches=2",
           "trainer.checkpoint_every=0", "trainer.monitor=null", "scheduler.warmup_steps=10",
           f"trainer.mixed_precision={args.mixed_precision}", f"hydra.run.dir={run_dir}"]
    run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    events = scalars(run_dir, "train/loss")
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = summary["peak_memory_gib"]
    # The final evaluation (2 batches): with trainer.compile, almost all of it is compiling the evaluation graph.
    return {"step_s": per_step([(e.step, e.wall_time) for e in events]),
            "peak_memory_gib": memory.get("cuda", memory["rss_max_over_ranks"]),
            "evaluation_s": summary["time_s"]["of which evaluation"]}


def gpu_nanogpt(args, batch: int, accumulation: int, compiled: bool, work: Path) -> dict:
    cmd = [sys.executable, "-c", NANOGPT_WITH_PEAK_MEMORY, "config/train_gpt2.py", *nanogpt_shape(args),
           f"--device={args.device}", "--dataset=bench_bytes",
           f"--batch_size={batch}", f"--gradient_accumulation_steps={accumulation}", f"--compile={compiled}",
           f"--max_iters={args.steps}", f"--lr_decay_iters={args.steps}", "--warmup_iters=10", "--log_interval=10",
           "--eval_interval=1000000", "--eval_iters=1", "--wandb_log=False", "--always_save_checkpoint=False",
           f"--dtype={ {'bf16': 'bfloat16', 'no': 'float32'}[args.mixed_precision]}", f"--out_dir={work / 'out'}"]
    lines = timed_lines(cmd, work, dict(os.environ))
    stamps = [(int(line.split()[1].rstrip(":")), t) for t, line in lines if line.startswith("iter ")]
    peak = next(float(line.split()[1]) for _, line in lines if line.startswith("PEAK_MEMORY_GIB"))
    return {"step_s": per_step(stamps), "peak_memory_gib": peak}


def gpu_first_step(args, compiled: bool, bin_file: Path, tmp: Path) -> float:
    """Seconds from starting `python train.py` to its first optimizer step (compiled: with warm caches)."""
    run_dir = tmp / f"first-step-{compiled}"
    started = time.time()
    run([sys.executable, "train.py", "experiment=owt_tokens", *model_shape(args), f"data.path={bin_file}",
         "data.vocab_size=50304", "data.val_fraction=0.05", *compile_overrides(args, compiled),
         "trainer.max_steps=1", "trainer.log_every=1", "trainer.eval_batches=1", "trainer.monitor=null",
         f"trainer.mixed_precision={args.mixed_precision}", f"hydra.run.dir={run_dir}"],
        env={**os.environ, "TQDM_DISABLE": "1"})
    return scalars(run_dir, "train/loss")[0].wall_time - started


def gpu(args) -> dict:
    """The template against nanoGPT on one GPU, GPT-2-124M's shape, bf16, at each micro-batch x accumulation
    shape, compiled and eager: ms/step, tokens/s, MFU and peak memory of both, and the template's time to its
    first optimizer step. No download: both train on the byte tokens of the bundled text (vocab 50304)."""
    import numpy as np
    import torch

    from src.reporting.telemetry import flops_per_token, peak_tflops
    from src.schema.build import build
    from src.schema.data_sizes import resolve_data_sizes

    device = torch.device(args.device)
    peak = args.peak_tflops or peak_tflops(device, args.mixed_precision, None)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "model_shape": args.model_shape, "peak_tflops": peak,
              "template_compile_mode": args.compile_mode}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = np.frombuffer((ROOT / "data" / "tinyshakespeare.txt").read_bytes(), dtype=np.uint8).astype(np.uint16)
        bin_file = tmp / "bytes.bin"
        tokens.tofile(bin_file)
        work = tmp / "nanoGPT" if args.nanogpt else None
        if work:
            shutil.copytree(Path(args.nanogpt).resolve(), work, ignore=shutil.ignore_patterns(".git", "out*"))
            (work / "data" / "bench_bytes").mkdir(parents=True)
            split = int(len(tokens) * 0.95)  # no meta.pkl: nanoGPT then uses vocab 50304, as the template is told
            tokens[:split].tofile(work / "data" / "bench_bytes" / "train.bin")
            tokens[split:].tofile(work / "data" / "bench_bytes" / "val.bin")
        cfg = compose_config(["experiment=owt_tokens", *model_shape(args), f"data.path={bin_file}",
                              "data.vocab_size=50304"])
        cfg = resolve_data_sizes(cfg, build(cfg.data, group="data").sizes())
        flops = flops_per_token(build(cfg.model, group="model"))
        for shape in args.shapes:
            batch, accumulation = map(int, shape.split("x"))
            tokens_per_step = batch * accumulation * int(args.model_shape.split(",")[3])
            for compiled in [mode == "compiled" for mode in args.modes]:
                name = f"{shape} {'compiled' if compiled else 'eager'}"
                runs = {"template": [], **({"nanogpt": []} if work else {})}
                for repeat in range(args.repeats):
                    sides = [lambda: runs["template"].append(gpu_template(
                        args, batch, accumulation, compiled, tmp / f"{shape}-{compiled}-{repeat}", bin_file))]
                    if work:
                        sides.append(lambda: runs["nanogpt"].append(gpu_nanogpt(args, batch, accumulation, compiled,
                                                                                work)))
                    in_turn(repeat, *sides)
                entry = {}
                for side, results in runs.items():
                    step_s = median(r["step_s"] for r in results)
                    entry[side] = {"ms_per_step": round(step_s * 1e3, 1),
                                   "ms_per_step_runs": [round(r["step_s"] * 1e3, 1) for r in results],
                                   "tokens_per_s": round(tokens_per_step / step_s),
                                   "mfu": round(flops * tokens_per_step / step_s / (peak * 1e12), 4) if peak else None,
                                   "peak_memory_gib": round(max(r["peak_memory_gib"] for r in results), 2)}
                entry["template"]["final_evaluation_s"] = round(max(r["evaluation_s"] for r in runs["template"]), 2)
                if work:
                    ours, theirs = entry["template"]["tokens_per_s"], entry["nanogpt"]["tokens_per_s"]
                    entry["tokens_per_s_ratio"] = round(ours / theirs, 3)
                report[name] = entry
                print(json.dumps({name: entry}), file=sys.stderr, flush=True)
        report["template_first_step_s"] = {mode: round(gpu_first_step(args, mode == "compiled", bin_file, tmp), 2)
                                           for mode in args.modes}
    return report


# ------------------------------------------------------------------------------------------- stop-vote


def stop_vote_worker(args) -> None:
    """One rank (under torchrun): a stand-in step of matrix products, timed without a vote, with the loop's
    asynchronous one (src/faults/preemption.py) and with a blocking all-reduce in its place, alternating."""
    import torch
    import torch.distributed as dist

    from src.faults.preemption import PreemptionWatch

    dist.init_process_group("gloo")
    watch = PreemptionWatch(dist.get_world_size())
    x = torch.randn(args.size, args.size)

    def blocking() -> None:
        dist.all_reduce(torch.zeros(1), group=watch.group)

    votes = {"none": lambda: None, "async (the loop's)": watch.step_finished, "blocking": blocking}
    times = {name: [] for name in votes}
    for _ in range(args.repeats):
        for name, vote in votes.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                for _ in range(3):
                    x @ x
                vote()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    watch.close()
    if dist.get_rank() == 0:
        print(json.dumps({name: {"ms_per_step": round(median(t), 3), "runs": [round(v, 3) for v in t]}
                          for name, t in times.items()}))
    dist.destroy_process_group()


def stop_vote(args) -> dict:
    result = run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.processes}",
                  f"--master_port={free_port()}", __file__, "_stop_vote", f"--steps={args.steps}",
                  f"--size={args.size}", f"--repeats={args.repeats}"])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    base = report["none"]["ms_per_step"]
    for entry in report.values():
        entry["overhead_ms"] = round(entry["ms_per_step"] - base, 3)
    return {"processes": args.processes, **report}


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    from src.schema.trainer import CompileMode

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("parity", help="the template against an exact hand-written loop")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--peak-tflops", type=float, help="one device's peak dense TFLOP/s, for MFU")
    p.add_argument("--cpu-time", action="store_true",
                   help="also each side's CPU time and page faults per step (one more, shorter run per run)")
    h = commands.add_parser("_hand_written")  # one side of parity, in its own process(es)
    h.add_argument("--weights", required=True)
    for q in (p, h):
        q.add_argument("--device", default="cpu")
        q.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
        q.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. data.batch_size=64")
    n = commands.add_parser("nanogpt", help="config/experiment/nanogpt_shakespeare_char.yaml against nanoGPT")
    n.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    n.add_argument("--seeds", type=int, nargs="+", default=[1337], help="one run of each side per seed (x --repeats)")
    n.add_argument("overrides", nargs="*", help="Hydra overrides for the template's side, e.g. data.random_windows=false")
    s = commands.add_parser("startup", help="time to the first optimizer step")
    s.add_argument("overrides", nargs="*")
    g = commands.add_parser("gpu", help="the template against nanoGPT on one GPU, GPT-2-124M shape")
    g.add_argument("--nanogpt", help="a checkout of karpathy/nanoGPT (without one: the template alone)")
    g.add_argument("--shapes", nargs="+", default=["12x5", "32x2"], help="micro-batch x accumulation steps")
    g.add_argument("--modes", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    g.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the first 20 are not timed)")
    g.add_argument("--peak-tflops", type=float, help="one GPU's peak dense bf16 TFLOP/s (default: known GPUs)")
    g.add_argument("--model-shape", default=GPT2_SHAPE, help="n_layer,n_head,n_embd,block_size")
    g.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing with a small --model-shape")
    g.add_argument("--mixed-precision", default="bf16", choices=["bf16", "no"])
    g.add_argument("--compile-mode", default="default", choices=typing.get_args(CompileMode),
                   help="the template's trainer.compile_mode in the compiled runs (nanoGPT's stays torch's default)")
    c = commands.add_parser("checkpoint", help="checkpoint save MB/s against a raw write")
    c.add_argument("--n-layer", type=int, default=8)
    c.add_argument("--n-embd", type=int, default=512)
    c.add_argument("--dir", default=str(ROOT / "outputs"), help="where to write (the disk runs write to)")
    v = commands.add_parser("stop-vote", help="the per-step stop-signal vote's cost on several CPU processes")
    v.add_argument("--processes", type=int, default=2)
    w = commands.add_parser("_stop_vote")  # its ranks, under torchrun
    for q in (v, w):
        q.add_argument("--steps", type=int, default=500)
        q.add_argument("--size", type=int, default=512, help="the stand-in step's square matrices")
    for q in (p, n, s, c, g, v, w):
        q.add_argument("--repeats", type=int, default=1 if q is g else 3)
    args = parser.parse_args()
    if args.command == "_hand_written":
        hand_written(args)
        return
    if args.command == "_stop_vote":
        stop_vote_worker(args)
        return
    Path(getattr(args, "dir", ROOT)).mkdir(parents=True, exist_ok=True)
    report = {"parity": parity, "nanogpt": nanogpt, "startup": startup, "checkpoint": checkpoint,
              "gpu": gpu, "stop-vote": stop_vote}[args.command](args)
    if args.command == "parity":
        print(json.dumps(report, indent=2))
        print(json.dumps({k: {"weights_equal": v["weights_equal"], "step_time_ratio": v["step_time_ratio"]}
                          for k, v in report.items()}))  # the last line: what a script reads
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""parity: the template against the loop an engineer would write by hand for the same maths.

A real `train.py` run (through `accelerate launch`) against a plain PyTorch loop (through `torchrun` on more than
one process) that makes exactly the template's arithmetic, written out: the seedable sampler's order (a
permutation seeded by seed + epoch), whole global batches per epoch, micro-batch k of rank r holding batch
(s*K + k)*P + r, the loss summed and divided by the global batch's target count, DDP with no_sync on all but the
last micro-step, clipping, AdamW, the LR schedule. So the final weights must be bitwise equal, and the step-time
ratio is the template's overhead alone.

Measured the same way on both sides: fresh processes, alternating which side goes first; step time between the
first and the last logged step (start-up, the template's final evaluation and export excluded), medians
compared; peak memory the largest of all ranks (the template's summary, the loop's all-reduced maximum). With
--cpu-time, also the CPU time and minor page faults per step of all of a side's processes (a shorter run of each
cancels start-up): whether a gap is work or waiting.
"""

import contextlib
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import BENCHMARK, compose_config, free_port, in_turn, run, scalars
from scripts.benchmarks.common import peak_memory_over_ranks_gib


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
    peak = peak_memory_over_ranks_gib(device)  # as the template's summary reports it: the largest rank's
    if rank == 0:
        torch.save(model.state_dict(), args.weights)
        result = {"step_time_s": (times[-1] - times[0]) / (trainer.log_every * (len(times) - 1)),
                  "tokens_per_step": tokens_per_step, "peak_memory_gib": peak}
        print(json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()


def run_hand_written(args, processes: int, weights: Path, steps: int) -> dict:
    launcher = ([sys.executable] if processes == 1 else
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                 f"--master_port={free_port()}"])
    cmd = [*launcher, str(BENCHMARK), "_hand_written", f"--weights={weights}", f"--device={args.device}",
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

def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
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
    return {"parity": parity, "_hand_written": hand_written}

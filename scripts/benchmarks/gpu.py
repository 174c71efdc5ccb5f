"""gpu: the template against nanoGPT on one GPU at GPT-2-124M's shape (12 x 5 and 32 x 2 micro-steps, compiled
and eager): ms/step, tokens/s, MFU, peak memory, the template/nanoGPT ratio, the template's final-evaluation
time and its time to the first step. Without --nanogpt, the template alone; `--device cpu` with a small
--model-shape is a dry run of the plumbing (a test runs it).

Measured the same way on both sides: one process each on the same pre-tokenized data, the first
GPU_WARMUP_STEPS steps (compilation, allocator warm-up) untimed, step time from the timestamps of the lines each
prints per step, peak memory as CUDA reports it (each side's own process), in turns.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import ROOT, compose_config, in_turn, one_document_shards, run, scalars

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
        last = "\n".join(text for _, text in lines[-60:])
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{last}")
    return lines


def per_step(stamps: list[tuple[int, float]]) -> float:
    """Seconds per optimizer step between the first logged step after the warm-up and the last one."""
    timed = [(step, t) for step, t in stamps if step >= GPU_WARMUP_STEPS]
    (first, t0), (last, t1) = timed[0], timed[-1]
    return (t1 - t0) / (last - first)


def template_model_and_data(args, bin_file: Path) -> list[str]:
    """What every template run of this benchmark is, and what its FLOP count is computed on: one list, so they
    cannot differ (the FLOP count's copy once lacked the validation fraction and failed at GPT-2's block size).
    --template-data shards: the FineWeb recipe's loader (data=shards) on the same tokens, prepared beside the file."""
    if args.template_data == "shards":
        return ["experiment=fineweb_gpt2", *model_shape(args), f"data.path={shards_beside(bin_file)}"]
    return ["experiment=owt_tokens", *model_shape(args), f"data.path={bin_file}", "data.vocab_size=50304",
            "data.val_fraction=0.05"]


def shards_beside(bin_file: Path) -> Path:
    return bin_file.with_suffix(".shards")


def write_shards(tokens, folder: Path, val_fraction: float = 0.05) -> None:
    """The tokens as scripts/prepare_data.py lays a prepared folder out: one shard and one document per split, the
    validation the same last 5 % as nanoGPT's val.bin here (vocab 50304, as both sides are told)."""
    import numpy as np

    folder.mkdir()
    split = int(len(tokens) * (1 - val_fraction))
    written = {}
    for name, part in (("train", tokens[:split]), ("validation", tokens[split:])):
        part.astype(np.uint16).tofile(folder / f"{name}_00000.ds")
        written[name] = [(f"{name}_00000.ds", len(part))]
    one_document_shards(folder, written, 50304, "bytes", "benchmark")


def compile_overrides(args, compiled: bool) -> list[str]:
    """nanoGPT compiles in torch.compile's default mode; --compile-mode tries another for the template only."""
    if not compiled:
        return ["trainer.compile=false"]
    return ["trainer.compile=true", f"trainer.compile_mode={args.compile_mode}"]


def gpu_template(args, batch: int, accumulation: int, compiled: bool, run_dir: Path, bin_file: Path,
                 loader: list[str]) -> dict:
    cmd = [sys.executable, "train.py", *template_model_and_data(args, bin_file), f"data.batch_size={batch}", *loader,
           f"trainer.gradient_accumulation_steps={accumulation}", *compile_overrides(args, compiled),
           f"trainer.max_steps={args.steps}", "trainer.log_every=10", "trainer.eval_every=0", "trainer.eval_batches=2",
           "trainer.checkpoint_every=0", "trainer.monitor=null", "scheduler.warmup_steps=10",
           f"trainer.mixed_precision={args.mixed_precision}", f"hydra.run.dir={run_dir}"]
    run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    events = scalars(run_dir, "train/loss")
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = summary["peak_memory_gib"]
    waits = [e.value for e in scalars(run_dir, "train/data_wait") if e.step >= GPU_WARMUP_STEPS]
    # The final evaluation (2 batches): with trainer.compile, almost all of it is compiling the evaluation graph.
    return {"step_s": per_step([(e.step, e.wall_time) for e in events]),
            "peak_memory_gib": memory.get("cuda", memory["rss_max_over_ranks"]),
            "evaluation_s": summary["time_s"]["of which evaluation"],
            "data_wait_share": median(waits) if waits else None}


def template_sides(args) -> dict[str, list[str]]:
    """The template once per --data-workers value, and with --read-ahead once reading ahead in a thread: each
    side's loader settings, all of them given, whatever the experiment's config sets. "template" is the first, the
    others are named by their settings."""
    loaders = [[f"data.num_workers={workers}", "data.read_ahead=false"] for workers in args.data_workers]
    if args.read_ahead:
        loaders.append(["data.num_workers=0", "data.read_ahead=true"])
    return {"template" if i == 0 else f"template, {', '.join(loader)}": loader for i, loader in enumerate(loaders)}


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
    run([sys.executable, "train.py", *template_model_and_data(args, bin_file), *compile_overrides(args, compiled),
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
              "template_compile_mode": args.compile_mode, "template_data": args.template_data}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = np.frombuffer((ROOT / "data" / "tinyshakespeare.txt").read_bytes(), dtype=np.uint8).astype(np.uint16)
        bin_file = tmp / "bytes.bin"
        tokens.tofile(bin_file)
        write_shards(tokens, shards_beside(bin_file))
        work = tmp / "nanoGPT" if args.nanogpt else None
        if work:
            shutil.copytree(Path(args.nanogpt).resolve(), work, ignore=shutil.ignore_patterns(".git", "out*"))
            (work / "data" / "bench_bytes").mkdir(parents=True)
            split = int(len(tokens) * 0.95)  # no meta.pkl: nanoGPT then uses vocab 50304, as the template is told
            tokens[:split].tofile(work / "data" / "bench_bytes" / "train.bin")
            tokens[split:].tofile(work / "data" / "bench_bytes" / "val.bin")
        cfg = compose_config(template_model_and_data(args, bin_file))
        cfg = resolve_data_sizes(cfg, build(cfg.data, group="data").sizes())
        flops = flops_per_token(build(cfg.model, group="model"))
        for shape in args.shapes:
            batch, accumulation = map(int, shape.split("x"))
            tokens_per_step = batch * accumulation * int(args.model_shape.split(",")[3])
            for compiled in [mode == "compiled" for mode in args.modes]:
                name = f"{shape} {'compiled' if compiled else 'eager'}"
                templates = template_sides(args)
                runs = {**{side: [] for side in templates}, **({"nanogpt": []} if work else {})}
                for repeat in range(args.repeats):
                    sides = [lambda side=side, i=i, loader=loader: runs[side].append(gpu_template(
                        args, batch, accumulation, compiled, tmp / f"{shape}-{compiled}-{i}-{repeat}", bin_file,
                        loader)) for i, (side, loader) in enumerate(templates.items())]
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
                for side in templates:
                    entry[side]["final_evaluation_s"] = round(max(r["evaluation_s"] for r in runs[side]), 2)
                    waits = [r["data_wait_share"] for r in runs[side] if r["data_wait_share"] is not None]
                    # train/data_wait: the share of the logged steps' time spent waiting for batches, after warm-up
                    entry[side]["data_wait_share"] = round(median(waits), 5) if waits else None
                if work:
                    ours, theirs = entry["template"]["tokens_per_s"], entry["nanogpt"]["tokens_per_s"]
                    entry["tokens_per_s_ratio"] = round(ours / theirs, 3)
                report[name] = entry
                print(json.dumps({name: entry}), file=sys.stderr, flush=True)
        report["template_first_step_s"] = {mode: round(gpu_first_step(args, mode == "compiled", bin_file, tmp), 2)
                                           for mode in args.modes}
    return report

def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    from src.schema.trainer import CompileMode

    g = commands.add_parser("gpu", help="the template against nanoGPT on one GPU, GPT-2-124M shape")
    g.add_argument("--nanogpt", help="a checkout of karpathy/nanoGPT (without one: the template alone)")
    g.add_argument("--shapes", nargs="+", default=["12x5", "32x2"], help="micro-batch x accumulation steps")
    g.add_argument("--modes", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    g.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the first 20 are not timed)")
    g.add_argument("--peak-tflops", type=float, help="one GPU's peak dense bf16 TFLOP/s (default: known GPUs)")
    g.add_argument("--model-shape", default=GPT2_SHAPE, help="n_layer,n_head,n_embd,block_size")
    g.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing with a small --model-shape")
    g.add_argument("--mixed-precision", default="bf16", choices=["bf16", "no"])
    g.add_argument("--template-data", default="tokens", choices=["tokens", "shards"],
                   help="the template reads the tokens as one file (data=tokens, experiment=owt_tokens) or as "
                        "prepared shards (data=shards, experiment=fineweb_gpt2)")
    g.add_argument("--data-workers", nargs="+", type=int, default=[0],
                   help="the template's data.num_workers: one run per value and shape (nanoGPT reads in its loop)")
    g.add_argument("--read-ahead", action="store_true",
                   help="one more template run per shape with data.read_ahead=true (a thread reads the next step's "
                        "micro-batches)")
    g.add_argument("--compile-mode", default="default", choices=typing.get_args(CompileMode),
                   help="the template's trainer.compile_mode in the compiled runs (nanoGPT's stays torch's default)")
    return {"gpu": gpu}

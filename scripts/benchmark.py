"""Is the template as fast as a hand-written loop? Same model, data, batch, optimizer and threads.

    python scripts/benchmark.py                              # CPU: the default GPT on tiny Shakespeare
    python scripts/benchmark.py --device cuda --mixed-precision bf16 --peak-tflops 989 \
        model.n_layer=6 model.n_embd=384 model.n_head=6 model.block_size=256 data.batch_size=64

The template side is a real `train.py` run (evaluation and checkpoints off); its throughput comes from the
wall times TensorBoard recorded for train/loss between the first and the last logged step, so start-up is
left out on both sides. The hand-written side is a plain PyTorch loop (forward, backward, clip, AdamW,
LR schedule). Reports tokens/s, the template's overhead, peak memory and, with --peak-tflops, MFU.
Results are kept in scripts/BENCHMARKS.md.
"""

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def hand_written(args, overrides: list[str]) -> dict:
    """The loop an engineer would write by hand, on the config train.py would use."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir

    from src.config import complete_config
    from src.optim import param_groups
    from src.schema import build, resolve_data_sizes

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base="1.3"):
        cfg = complete_config(compose(config_name="train", overrides=overrides))
    torch.manual_seed(cfg.trainer.seed)
    if args.device == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    device = torch.device(args.device)
    data = build(cfg.data, group="data")
    cfg = resolve_data_sizes(cfg, data.sizes())
    model = build(cfg.model, group="model").to(device)
    optimizer = build(cfg.optimizer, param_groups(model), group="optimizer")
    scheduler = build(cfg.scheduler, optimizer, group="scheduler")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    loader = data.train_dataloader()
    batches, times = iter(loader), []
    for step in range(args.steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets = next(batches)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(inputs).float().flatten(0, -2), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if (step + 1) % args.log_every == 0:
            loss.item()  # the same host sync train.py makes when it logs
            times.append(time.perf_counter())
    tokens_per_step = cfg.data.batch_size * (inputs[0].numel() if inputs.dim() == 2 else 1)
    result = {"tokens_per_s": tokens_per_step * args.log_every * (len(times) - 1) / (times[-1] - times[0])}
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if hasattr(model, "flops_per_token"):
        result["flops_per_token"] = model.flops_per_token()
    return result


def template(args, overrides: list[str]) -> dict:
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "train.py", *overrides, f"trainer.max_steps={args.steps}",
               f"trainer.log_every={args.log_every}", "trainer.eval_every=0", "trainer.checkpoint_every=0",
               "trainer.monitor=null", f"trainer.mixed_precision={args.mixed_precision}", f"hydra.run.dir={run_dir}/r"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "TQDM_DISABLE": "1"})
        acc = EventAccumulator(f"{run_dir}/r/tensorboard")
        acc.Reload()
        events = acc.Scalars("train/loss")
        cfg = OmegaConf.load(f"{run_dir}/r/config.yaml")  # what the run really used
    # A token per position for a language model, one per image for a classifier (as on the hand-written side).
    tokens_per_step = cfg.data.batch_size * cfg.data.get("block_size", 1) * cfg.trainer.gradient_accumulation_steps
    elapsed = events[-1].wall_time - events[0].wall_time
    return {"tokens_per_s": tokens_per_step * (events[-1].step - events[0].step) / elapsed,
            "peak_rss_gib_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--peak-tflops", type=float, help="the device's peak dense TFLOP/s, for MFU")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. data.batch_size=64")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side; medians are reported")
    parser.add_argument("--hand-written-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand_written_only:
        print(json.dumps(hand_written(args, args.overrides)))
        return

    # Both sides in fresh processes, alternating, so neither gets a warmer cache or a luckier memory layout.
    runs: dict[str, list[dict]] = {"template": [], "hand_written": []}
    for _ in range(args.repeats):
        runs["template"].append(template(args, args.overrides))
        child = subprocess.run([sys.executable, __file__, "--hand-written-only", *sys.argv[1:]], check=True,
                               capture_output=True, text=True)
        runs["hand_written"].append(json.loads(child.stdout.strip().splitlines()[-1]))
    ours, theirs = (sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for r in runs.values())
    report = {
        "template_tokens_per_s_runs": [round(r["tokens_per_s"]) for r in runs["template"]],
        "hand_written_tokens_per_s_runs": [round(r["tokens_per_s"]) for r in runs["hand_written"]],
        "template_tokens_per_s": round(ours["tokens_per_s"]),
        "hand_written_tokens_per_s": round(theirs["tokens_per_s"]),
        "template_overhead_percent": round(100 * (theirs["tokens_per_s"] / ours["tokens_per_s"] - 1), 1),
        **{f"hand_written_{k}": round(v, 3) for k, v in theirs.items() if "memory" in k or "rss" in k},
        "template_peak_rss_gib": round(ours["peak_rss_gib_children"], 3),
    }
    if args.peak_tflops and "flops_per_token" in theirs:
        for name, side in (("template", ours), ("hand_written", theirs)):
            report[f"{name}_mfu_percent"] = round(
                100 * theirs["flops_per_token"] * side["tokens_per_s"] / (args.peak_tflops * 1e12), 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

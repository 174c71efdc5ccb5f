"""scale: one model size after another (a Llama from a transformers config), trained by train.py under each layout
on N processes: one process alone, DDP, FSDP2 (config/accelerate/fsdp.yaml, its sharded start) and FSDP2 with a
whole copy per rank at the start. Per size and layout: each rank's peak resident memory (and CUDA's peak on GPUs),
the step time, tokens/s, how long the loop was blocked by a checkpoint save, the time to the first step of a fresh
run and of a run resumed from that checkpoint, and the final export's time and each rank's peak while it ran.

Every layout runs the same train.py with the same overrides, so every side is measured the same way: memory from
the run's summary.json (each rank's peak RSS, read by the rank itself at the end), times from its summary and
TensorBoard. A layout whose model state (weights, gradients, AdamW's moments) per rank exceeds the host's
available memory is not started (an out-of-memory kill can take the machine's other work with it): its row says
it would not fit, with the estimate. On CPU the FSDP2 runs go through tests/fsdp_on_cpu.py (accelerate runs its
FSDP plugin only on GPUs otherwise); on GPUs through train.py itself.

    python scripts/benchmark.py scale --sizes 10x640 16x1024 17x1536 --processes 2
    python scripts/benchmark.py scale --sizes 16x1024 --pretrained --layouts one fsdp2   # LoRA on a saved folder
    python scripts/benchmark.py scale --objective grpo --layouts ddp fsdp2 fsdp2_gather_off  # GRPO's rollouts

`--objective grpo` trains each size by GRPO on the bundled arithmetic prompts (the policy writes its completions,
the default verifiable reward scores them) in place of next-token prediction, so that each rank's peak includes
generation: under FSDP2 with objective.gather_for_generation (the default) every block is kept gathered for a
rollout, so a rank holds the whole weights while it writes; the layout fsdp2_gather_off gathers each block for
each token instead.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import ROOT, free_port, run, scalars

LAYOUTS = ("one", "ddp", "fsdp2", "fsdp2_whole_copy", "fsdp2_gather_off")
# A layout's own overrides: GRPO's generation gathering each block for each token (--objective grpo only).
LAYOUT_OVERRIDES = {"fsdp2_gather_off": ["objective.gather_for_generation=false"]}
LORA = "{peft_type: LORA, r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}"


def llama(layers: int, hidden: int, block: int) -> dict:
    heads = max(1, hidden // 64)
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 11 * hidden // 4,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "max_position_embeddings": block, "tie_word_embeddings": False}


def launch(layout: str, processes: int) -> list[str]:
    import torch

    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    if layout == "one":
        return [sys.executable, "train.py"]
    if layout == "ddp":
        return [*launcher, "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                "--dynamo_backend", "no", "train.py"]
    script = "train.py" if torch.cuda.is_available() else "tests/fsdp_on_cpu.py"
    whole = ["--fsdp_cpu_ram_efficient_loading", "false"] if layout == "fsdp2_whole_copy" else []
    return [*launcher, "--config_file", "config/accelerate/fsdp.yaml", "--num_processes", str(processes), *whole,
            script]


BASE_PER_PROCESS = 0.6 * 2**30  # a training process before its model: torch, transformers, the data


def state_per_rank(model, layout: str, processes: int, pretrained: bool) -> int:
    """The banner's arithmetic (src/launch/memory.py) for the layout, LoRA's adapter left out (too small to count);
    DDP keeps one more gradient-sized copy in its all-reduce buckets (trainer.ddp_gradient_as_bucket_view=false)."""
    from src.launch.memory import model_state

    if pretrained:
        model.requires_grad_(False)
    state = model_state(model, "torch.optim.AdamW", processes if layout.startswith("fsdp2") else 1)
    return int(state.total + (state.gradients if layout == "ddp" else 0) + BASE_PER_PROCESS)


def available_bytes() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return int(fields["MemAvailable"].split()[0]) * 1024


def one_size(args, layers: int, hidden: int, work: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = llama(layers, hidden, args.block_size)
    with torch.device("meta"):  # shapes only: the bundled text's 65 characters
        meta_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config, vocab_size=65))
    parameters = sum(p.numel() for p in meta_model.parameters())
    objective = ["objective=causal_lm"] if args.objective == "causal_lm" else [
        "data=prompts", "objective=grpo", f"objective.max_completion_tokens={args.completion_tokens}",
        "objective.num_generations=2"]  # a group of two completions per prompt
    model = ["model=hf_causal_lm", f"model.block_size={args.block_size}", *objective, "~model.config",
             "+model.config=" + json.dumps({**config, "vocab_size": "${dataset:vocab_size}"}).replace('"', "")]
    if args.pretrained:  # a saved folder of this size, each layout reads it; LoRA trains on it
        folder = work / f"pretrained_{layers}x{hidden}"
        if not folder.is_dir():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(AutoConfig.for_model(**config, vocab_size=65)).save_pretrained(folder)
        model = ["model=hf_causal_lm", f"model.block_size={args.block_size}", *objective,
                 f"model.pretrained={folder}", f"model.peft={LORA}", "data.tokenizer=null"]
    common = [*model, f"data.batch_size={args.batch_size}", f"trainer.max_steps={args.steps}",
              f"trainer.checkpoint_every={args.steps - 1}", f"trainer.async_checkpoint={str(args.async_save).lower()}",
              "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.monitor=null",
              "trainer.hang_report_s=3600", f"optimizer={args.optimizer}"]
    rows = {"parameters": parameters}
    for layout in args.layouts:
        if layout in LAYOUT_OVERRIDES and args.objective != "grpo":
            raise SystemExit(f"--layouts {layout} is a GRPO layout: add --objective grpo")
        processes = 1 if layout == "one" else args.processes
        needed = state_per_rank(meta_model, layout, processes, args.pretrained) * processes
        if not torch.cuda.is_available() and needed > available_bytes():
            rows[layout] = {"would_not_fit": f"model state and imports {needed / 2**30:.1f} GiB on this host (all "
                                             f"ranks), {available_bytes() / 2**30:.1f} GiB available"}
            continue
        run_dir, resumed_dir = work / f"{layers}x{hidden}_{layout}", work / f"{layers}x{hidden}_{layout}_resumed"
        own = [*common, *LAYOUT_OVERRIDES.get(layout, [])]
        run([*launch(layout, processes), *own, f"hydra.run.dir={run_dir}"])
        checkpoint = run_dir / "checkpoints" / f"step_{args.steps - 1:08d}"
        run([*launch(layout, processes), *own, f"resume={checkpoint}", f"hydra.run.dir={resumed_dir}"])
        summary = json.loads((run_dir / "summary.json").read_text())
        resumed = json.loads((resumed_dir / "summary.json").read_text())
        step_times = [s.value for s in scalars(run_dir, "train/step_time")][1:]  # the first step compiles, warms
        memory = summary["peak_memory_gib"]
        rows[layout] = {
            "processes": processes,
            "peak_rss_gib_per_rank": [round(m, 2) for m in memory["rss_per_rank"]],
            "start_up_peak_rss_gib_per_rank": [round(m, 2) for m in memory["rss_per_rank_before_the_first_step"]],
            **({"cuda_peak_gib": round(memory["cuda"], 2)} if "cuda" in memory else {}),
            "step_time_s": round(median(step_times), 2),
            "tokens_per_second": round(summary["tokens_per_second"], 1),
            "save_blocked_s": round(scalars(run_dir, "checkpoint/blocking_s")[0].value, 2),
            "checkpoint_gb": round(sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 1e9, 2),
            "first_step_after_s": round(summary["time_s"]["start-up"], 1),
            "first_step_after_resume_s": round(resumed["time_s"]["start-up"], 1),
            # The final export (after the summary's peak): each rank's peak while it ran, and its time.
            "export_peak_rss_gib_per_rank": summary.get("export", {}).get("peak_rss_gib_per_rank"),
            "export_s": summary.get("export", {}).get("seconds"),
        }
        shutil.rmtree(run_dir), shutil.rmtree(resumed_dir)  # gigabytes of checkpoints per size and layout
    peaks = {k: max(v["peak_rss_gib_per_rank"]) for k, v in rows.items() if isinstance(v, dict) and "processes" in v}
    for layout, base in (("fsdp2", "ddp"), ("fsdp2", "one"), ("fsdp2", "fsdp2_gather_off")):
        if layout in peaks and base in peaks:
            rows[f"{layout}_over_{base}_peak"] = round(peaks[layout] / peaks[base], 2)
    return rows


def scale(args) -> dict:
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    report = {"glibc_malloc_mmap_threshold": args.malloc_mmap_threshold or "train.py's (32 MiB on CPU)"}
    if args.malloc_mmap_threshold:  # every layout's processes alike (they inherit the environment)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for size in args.sizes:
            layers, hidden = (int(x) for x in size.split("x"))
            report[size] = one_size(args, layers, hidden, Path(tmp))
            # A long benchmark: each size as it ends, on stderr (stdout is the one JSON report a script reads).
            print(json.dumps({size: report[size]}), file=sys.stderr, flush=True)
    return report


def add_commands(commands) -> dict:
    c = commands.add_parser("scale", help="memory and time per rank by model size: one process, DDP, FSDP2")
    c.add_argument("--sizes", nargs="+", default=["10x640", "16x1024"], help="LAYERSxHIDDEN, Llama-shaped")
    c.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["ddp", "fsdp2", "fsdp2_whole_copy"])
    c.add_argument("--processes", type=int, default=2)
    c.add_argument("--steps", type=int, default=3, help="optimizer steps; a checkpoint at the one before last")
    c.add_argument("--batch-size", type=int, default=2)
    c.add_argument("--block-size", type=int, default=256)
    c.add_argument("--pretrained", action="store_true", help="LoRA on a saved pretrained folder of each size")
    c.add_argument("--objective", choices=["causal_lm", "grpo"], default="causal_lm", help="grpo: GRPO on the "
                   "bundled arithmetic prompts, generation included in each rank's peak")
    c.add_argument("--completion-tokens", type=int, default=32, help="--objective grpo: each completion's length")
    c.add_argument("--async-save", action="store_true", help="trainer.async_checkpoint=true")
    c.add_argument("--optimizer", default="adamw", help="the optimizer option every layout trains with (muon: its "
                                                        "state is one buffer a matrix, AdamW's two)")
    c.add_argument("--dir", default=str(ROOT / "outputs" / "scale"), help="where the runs and checkpoints go")
    c.add_argument("--malloc-mmap-threshold", type=int, default=None, help=(
        "glibc's MALLOC_MMAP_THRESHOLD_ for every run, in place of the 32 MiB train.py sets on CPU for speed "
        "(src/launch/accelerator.py: keep_freed_memory), under which freed layer-sized blocks stay resident"))
    return {"scale": scale}

"""preference: DPO's step time and peak memory with LoRA (the reference is the base with the adapter switched off:
no second copy) against full fine-tuning with a frozen reference copy, each against TRL's DPOTrainer on the same
work.

The model is a GPT-2 written by scripts/make_tiny_pretrained.py at --layers x --width (random weights: the
figures are about cost, not quality), the pairs data/shakespeare_pairs.jsonl (600, none longer than the block), in
fp32 on one process, --batch pairs per step, AdamW at the same learning rate, no evaluation and no checkpoint until
the end, and activation checkpointing on both sides or on neither (--checkpointing; TRL's own default is on).
Ours is train.py (objective=dpo, reference=adapter with model.peft, reference=copy without); its step time is the
median of train/step_time over the logged intervals after the first, its peak memory the run summary's resident
peak. TRL's is DPOTrainer (peft_config for LoRA; its own reference copy without), timed per step by a callback
(median after the first steps), its peak the process's resident peak (resource.getrusage), in a process of its
own (`_trl_dpo`). The sides take turns (in_turn); medians over the repeats.

With --packing it compares ours with itself instead: LoRA DPO on padded pairs against the same pairs packed
(data.packing=true, TRL's padding_free), with the tokens the model computes per step on each (the batches' rows
times their width, counted by collating the run's pairs as its loader does).
"""

import json
import resource
import sys
import tempfile
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import BENCHMARK, ROOT, in_turn, run, scalars, trainer_step_times

PAIRS = ROOT / "data" / "shakespeare_pairs.jsonl"
LORA_TARGETS = ["c_attn"]


def model_folder(directory: Path, layers: int, width: int) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_pretrained import make_tiny_pretrained

    folder = directory / f"gpt2_{layers}x{width}"
    make_tiny_pretrained(folder, ROOT / "data" / "tinyshakespeare.txt", steps=0, positions=256, n_layer=layers,
                         n_embd=width, n_head=max(1, width // 64))
    return folder


def ours(folder: Path, lora: bool, args, packing: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run(["accelerate", "launch", "--num_processes", "1", "train.py", "model=hf_causal_lm",
             f"model.pretrained={folder}", "model.block_size=256", "data=jsonl", f"data.path={PAIRS}",
             "data.preference=true", f"data.packing={str(packing).lower()}", f"data.batch_size={args.batch}",
             "objective=dpo",
             *([f"model.peft={{peft_type: LORA, r: 8, lora_alpha: 16, target_modules: {LORA_TARGETS}}}"] if lora
               else ["objective.reference=copy"]),
             f"model.gradient_checkpointing={str(args.checkpointing).lower()}",
             f"optimizer.lr={args.lr}", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
             "trainer.checkpoint_every=0", "trainer.eval_batches=1", "trainer.monitor=null",
             f"trainer.log_every={args.log_every}", f"hydra.run.dir={tmp}/run"])
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        step_times = [s.value for s in scalars(Path(tmp) / "run", "train/step_time")][1:]
    return {"ms_per_step": 1000 * median(step_times), "peak_rss_gib": max(summary["peak_memory_gib"]["rss_per_rank"])}


def theirs(folder: Path, lora: bool, args) -> dict:
    done = run([sys.executable, str(BENCHMARK), "_trl_dpo", str(folder), "--batch", str(args.batch), "--steps",
                str(args.steps), "--lr", str(args.lr), *(["--lora"] if lora else []),
                *(["--checkpointing"] if args.checkpointing else [])])
    return json.loads(done.stdout.strip().splitlines()[-1])


def trl_dpo(args) -> None:
    """One TRL DPOTrainer run (a worker process): prints its median step time and the process's peak RSS."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    timer, times = trainer_step_times()

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.folder),
            processing_class=AutoTokenizer.from_pretrained(args.folder), train_dataset=Dataset.from_list(rows),
            peft_config=peft_config, callbacks=[timer],
            args=DPOConfig(output_dir=tmp, per_device_train_batch_size=args.batch, learning_rate=args.lr,
                           max_steps=args.steps, max_length=None, bf16=False, use_cpu=True, report_to=[],
                           save_strategy="no", logging_steps=10_000, lr_scheduler_type="constant",
                           dataloader_num_workers=0, disable_tqdm=True,
                           gradient_checkpointing=args.checkpointing))  # TRL's default is true; ours false
        trainer.train()
    print(json.dumps({"ms_per_step": 1000 * median(times[2:]),
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def tokens_per_step(folder: Path, batch: int, packing: bool) -> tuple[float, float]:
    """(the tokens the model computes per step: rows times width, padding included; the pairs' own tokens: each
    prompt twice, with each answer), averaged over one epoch's batches."""
    from src.data.jsonl import JsonlData

    data = JsonlData(block_size=256, path=str(PAIRS), tokenizer=str(folder), preference=True, packing=packing)
    pairs = [data.train[i] for i in range(len(data.train))]
    batches = [pairs[i:i + batch] for i in range(0, len(pairs), batch)]
    computed = [data.collate_fn(b)["input_ids"].numel() for b in batches]
    own = [sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in b) for b in batches]
    return sum(computed) / len(batches), sum(own) / len(batches)


def packed_against_padded(args) -> dict:
    sides = {"padded": [], "packed": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), args.layers, args.width)
        for repeat in range(args.repeats):
            in_turn(repeat, *(lambda side=side: sides[side].append(ours(folder, True, args, side == "packed"))
                              for side in sides))
        tokens = {side: tokens_per_step(folder, args.batch, side == "packed") for side in sides}
    report = {f"ours lora, {side}": {**{key: round(median(r[key] for r in runs), 3) for key in runs[0]},
                                     "model_tokens_per_step": round(tokens[side][0]),
                                     "padding_share": round(1 - tokens[side][1] / tokens[side][0], 3)}
              for side, runs in sides.items()}
    report["packed over padded, step time"] = round(report["ours lora, packed"]["ms_per_step"]
                                                    / report["ours lora, padded"]["ms_per_step"], 2)
    report["setup"] = {"layers": args.layers, "width": args.width, "batch_pairs": args.batch, "steps": args.steps,
                       "block_size": 256, "processes": 1, "precision": "fp32",
                       "activation_checkpointing": args.checkpointing}
    return report


def preference(args) -> dict:
    if args.packing:
        return packed_against_padded(args)
    sides = {f"{who} {how}": [] for how in ("lora", "full") for who in ("ours", "trl")}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), args.layers, args.width)
        for repeat in range(args.repeats):
            for how in ("lora", "full"):
                in_turn(repeat, lambda: sides[f"ours {how}"].append(ours(folder, how == "lora", args)),
                        lambda: sides[f"trl {how}"].append(theirs(folder, how == "lora", args)))
    report = {name: {key: round(median(r[key] for r in runs), 3) for key in runs[0]} for name, runs in sides.items()}
    for how in ("lora", "full"):
        report[f"{how}: ours over trl, step time"] = round(report[f"ours {how}"]["ms_per_step"]
                                                           / report[f"trl {how}"]["ms_per_step"], 2)
    report["setup"] = {"layers": args.layers, "width": args.width, "batch_pairs": args.batch, "steps": args.steps,
                       "processes": 1, "precision": "fp32", "activation_checkpointing": args.checkpointing}
    return report


def add_commands(commands) -> dict:
    c = commands.add_parser("preference", help="DPO with LoRA vs full fine-tuning with a reference copy, vs TRL")
    c.add_argument("--layers", type=int, default=8)
    c.add_argument("--width", type=int, default=512)
    c.add_argument("--batch", type=int, default=8, help="pairs per step")
    c.add_argument("--steps", type=int, default=30)
    c.add_argument("--log-every", type=int, default=5)
    c.add_argument("--lr", type=float, default=1e-4)
    c.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing on both sides (TRL's default; model.gradient_checkpointing)")
    c.add_argument("--packing", action="store_true", help="ours on padded pairs against the same pairs packed")
    w = commands.add_parser("_trl_dpo")
    w.add_argument("folder")
    for name, kind in (("--batch", int), ("--steps", int), ("--lr", float)):
        w.add_argument(name, type=kind, required=True)
    w.add_argument("--lora", action="store_true")
    w.add_argument("--checkpointing", action="store_true")
    return {"preference": preference, "_trl_dpo": trl_dpo}

"""packing: training throughput with data.packing=true (whole documents packed into blocks, each attending to
itself only) against padded documents (data.packing=false), on documents of mixed lengths.

Both sides are train.py runs of the same model (model=hf_causal_lm's GPT-2 from a config, or the template's GPT
with --model gpt), on the same file (data/shakespeare_speeches.jsonl: 3,000 speeches of 4 to 2,850 bytes, median
84, byte-level tokens), with the same block size, samples per step, steps and seed, and no evaluation or checkpoint
until the end. Documents longer than the block are truncated on both sides, so both train on the same tokens.
Each side's figure is trained tokens per second: its summary's counted targets (padding and every document's
first token excluded) over the training time less evaluation and checkpointing. The sides take turns
(in_turn); medians over the repeats.
"""

import json
import tempfile
from pathlib import Path
from statistics import median

from scripts.benchmarks.common import in_turn, run

MODELS = {"hf_causal_lm": ["model=hf_causal_lm", "model.config.n_layer=4", "model.config.n_embd=128",
                           "model.config.n_head=4"],
          "gpt": ["model=gpt", "model.n_layer=4", "model.n_embd=128", "model.n_head=4"]}


def packing(args) -> dict:
    sides = {"padded": [], "packed": []}

    def side(name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            run(["accelerate", "launch", "--num_processes", "1", "train.py", *MODELS[args.model],
                 f"model.block_size={args.block_size}", "data=hf_dataset", "data.path=data/shakespeare_speeches.jsonl",
                 f"data.packing={'true' if name == 'packed' else 'false'}", "objective=causal_lm",
                 f"data.batch_size={args.batch}", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
                 "trainer.checkpoint_every=0", "trainer.eval_batches=1", "trainer.log_every=1000",
                 f"hydra.run.dir={tmp}/run"])
            summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        time_s = summary["time_s"]
        targets = summary["tokens_per_second"] * time_s["training"]
        stepping = time_s["training"] - time_s["of which evaluation"] - time_s["of which checkpointing"]
        sides[name].append({"tokens_per_s": targets / stepping, "ms_per_step": 1000 * stepping / args.steps,
                            "targets_per_step": targets / args.steps})

    for repeat in range(args.repeats):
        in_turn(repeat, lambda: side("padded"), lambda: side("packed"))
    report = {name: {key: round(median(r[key] for r in runs), 1) for key in runs[0]} for name, runs in sides.items()}
    report["packed_over_padded_tokens_per_s"] = round(report["packed"]["tokens_per_s"]
                                                      / report["padded"]["tokens_per_s"], 2)
    report["setup"] = {"model": args.model, "block_size": args.block_size, "batch": args.batch, "steps": args.steps}
    return report


def add_commands(commands) -> dict:
    c = commands.add_parser("packing", help="trained tokens/s of data.packing=true against padded documents")
    c.add_argument("--model", choices=sorted(MODELS), default="hf_causal_lm")
    c.add_argument("--block-size", type=int, default=256)
    c.add_argument("--batch", type=int, default=8, help="samples (blocks or documents) per step")
    c.add_argument("--steps", type=int, default=30)
    return {"packing": packing}

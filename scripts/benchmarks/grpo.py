"""grpo: GRPO's step time with the micro-batch's prompts written together (objective.generation_batch=micro_batch,
the default) and one prompt's group at a time (prompt), each against TRL's GRPOTrainer on the same work; and with
each batch of completions trained --iterations steps (num_iterations on both sides: generation in one step of
each cycle, the writing policy's log-probabilities kept for the others).

The model is a GPT-2 written by scripts/make_tiny_pretrained.py at --layers x --width (random weights, so that no
completion ends early: every side writes --completion tokens for every completion, and the figures are about
cost), the prompts those of data/shakespeare_pairs.jsonl, --prompts per step with --generations completions each,
sampled at temperature 1 without top-k or top-p, rewarded by `letter_share` below (a function: no reward model's
cost), loss dapo, no KL term, AdamW at the same learning rate, fp32, one process. Ours is train.py (objective=grpo);
its step time the median of train/step_time over the logged intervals after the first. TRL's is GRPOTrainer
(generation by transformers' generate, batched and left-padded with its KV cache, as ours), timed per step by a
callback (median after the first steps), in a process of its own (`_trl_grpo`). With --iterations the steps of a
cycle differ (one writes, the others do not), so both sides report the mean over whole cycles after the first:
ours logs once a cycle. The sides take turns (in_turn); medians over the repeats.
"""

import json
import sys
import tempfile
from pathlib import Path
from statistics import mean, median

from scripts.benchmarks.common import BENCHMARK, ROOT, in_turn, run, scalars, trainer_step_times
from scripts.benchmarks.preference import model_folder

PROMPTS = ROOT / "data" / "shakespeare_pairs.jsonl"


def letter_share(prompts: list, completions: list[str], **columns) -> list[float]:
    """The share of a completion's characters that are the letter e: cheap, and the same on both sides."""
    return [text.count("e") / max(len(text), 1) for text in completions]


def ours(folder: Path, generation_batch: str, args, iterations: int = 1) -> dict:
    log_every = args.log_every if iterations == 1 else iterations  # a cycle per logged interval: its mean step
    with tempfile.TemporaryDirectory() as tmp:
        run(["accelerate", "launch", "--num_processes", "1", "train.py", "model=hf_causal_lm",
             f"model.pretrained={folder}", "model.block_size=256", "data=prompts", f"data.path={PROMPTS}",
             f"data.batch_size={args.prompts}", "objective=grpo", f"objective.reward={__name__}.letter_share",
             f"objective.num_generations={args.generations}", f"objective.max_completion_tokens={args.completion}",
             f"objective.generation_batch={generation_batch}", f"objective.num_iterations={iterations}",
             f"optimizer.lr={args.lr}", "scheduler=constant", f"trainer.max_steps={args.steps}",
             "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.eval_batches=1", "trainer.monitor=null",
             f"trainer.log_every={log_every}", f"hydra.run.dir={tmp}/run"])
        step_times = [s.value for s in scalars(Path(tmp) / "run", "train/step_time")][1:]
    return {"ms_per_step": 1000 * (median(step_times) if iterations == 1 else mean(step_times))}


def theirs(folder: Path, args, iterations: int = 1) -> dict:
    done = run([sys.executable, str(BENCHMARK), "_trl_grpo", str(folder), "--prompts", str(args.prompts),
                "--generations", str(args.generations), "--completion", str(args.completion), "--steps",
                str(args.steps), "--lr", str(args.lr), "--iterations", str(iterations)])
    return json.loads(done.stdout.strip().splitlines()[-1])


def trl_grpo(args) -> None:
    """One TRL GRPOTrainer run (a worker process): prints its median step time."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    rows = [{"prompt": json.loads(line)["prompt"]} for line in PROMPTS.read_text().splitlines()]
    timer, times = trainer_step_times()

    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.folder), reward_funcs=letter_share,
            processing_class=AutoTokenizer.from_pretrained(args.folder), train_dataset=Dataset.from_list(rows),
            callbacks=[timer],
            args=GRPOConfig(output_dir=tmp, per_device_train_batch_size=args.prompts * args.generations,
                            num_generations=args.generations, max_completion_length=args.completion,
                            temperature=1.0, top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", learning_rate=args.lr,
                            max_steps=args.steps, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                            logging_steps=10_000, lr_scheduler_type="constant", dataloader_num_workers=0,
                            disable_tqdm=True, gradient_checkpointing=False, num_iterations=args.iterations))
        trainer.train()
    cycles = times[args.iterations:][:(len(times) - args.iterations) // args.iterations * args.iterations]
    print(json.dumps({"ms_per_step": 1000 * (median(times[2:]) if args.iterations == 1 else mean(cycles))}))


def grpo(args) -> dict:
    cycle = f"num_iterations={args.iterations}"
    sides = {"ours micro_batch": [], "ours prompt": [], "trl": [], f"ours {cycle}": [], f"trl {cycle}": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), args.layers, args.width)
        for repeat in range(args.repeats):
            in_turn(repeat, lambda: sides["ours micro_batch"].append(ours(folder, "micro_batch", args)),
                    lambda: sides["ours prompt"].append(ours(folder, "prompt", args)),
                    lambda: sides["trl"].append(theirs(folder, args)),
                    lambda: sides[f"ours {cycle}"].append(ours(folder, "micro_batch", args, args.iterations)),
                    lambda: sides[f"trl {cycle}"].append(theirs(folder, args, args.iterations)))
    report = {name: {"ms_per_step": round(median(r["ms_per_step"] for r in runs), 1)} for name, runs in sides.items()}
    for name, theirs_name in (("ours micro_batch", "trl"), ("ours prompt", "trl"), (f"ours {cycle}", f"trl {cycle}")):
        report[f"{name} over {theirs_name}, step time"] = round(
            report[name]["ms_per_step"] / report[theirs_name]["ms_per_step"], 2)
    report["setup"] = {"layers": args.layers, "width": args.width, "prompts_per_step": args.prompts,
                       "generations": args.generations, "completion_tokens": args.completion, "steps": args.steps,
                       "processes": 1, "precision": "fp32"}
    return report


def add_commands(commands) -> dict:
    c = commands.add_parser("grpo", help="GRPO: prompts written together or one at a time, vs TRL's GRPOTrainer")
    c.add_argument("--layers", type=int, default=4)
    c.add_argument("--width", type=int, default=256)
    c.add_argument("--prompts", type=int, default=4, help="prompts per step")
    c.add_argument("--generations", type=int, default=8, help="completions per prompt")
    c.add_argument("--completion", type=int, default=48, help="tokens per completion")
    c.add_argument("--steps", type=int, default=12)
    c.add_argument("--log-every", type=int, default=3)
    c.add_argument("--lr", type=float, default=1e-5)
    c.add_argument("--iterations", type=int, default=2, help="num_iterations of the last pair of sides")
    w = commands.add_parser("_trl_grpo")
    w.add_argument("folder")
    for name, kind in (("--prompts", int), ("--generations", int), ("--completion", int), ("--steps", int),
                       ("--lr", float), ("--iterations", int)):
        w.add_argument(name, type=kind, required=True)
    return {"grpo": grpo, "_trl_grpo": trl_grpo}

"""teacher-memory: what a frozen model costs each rank under FSDP2 before the first step. A distillation teacher
read in slices (an export: every rank builds it without values and reads only its shard's part,
src/models/pretrained_slices.py) against read whole by every rank first (a checkpoint of the same teacher, which is
still read so); and GRPO's reward model (an objective=reward run's export), read in slices the same way.

For each size (--teachers, layers x width of the template's GPT, trained for one step here so that it has an export
and a checkpoint; the reward model trained one step on preference pairs), a tiny student distils from the teacher's
export and from its checkpoint on --processes processes under accelerate's FSDP2 plugin (tests/fsdp_on_cpu.py on a
CPU), and a tiny policy takes a GRPO step against the reward model; each also once against a tiny teacher or reward
model: each rank's resident peak before the first step (the run's summary.json) over the tiny one's run is what the
large one cost it. Reported per size: the model's bytes, and that cost per rank.
"""

import json
import sys
import tempfile
from pathlib import Path

from scripts.benchmarks.common import run
from scripts.benchmarks.scale import launch

STUDENT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=32", "data.batch_size=8",
           "trainer.max_steps=1", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.monitor=null",
           "trainer.log_every=1"]
REWARD = ("model.head=reward", "data=jsonl", "data.path=data/shakespeare_pairs.jsonl", "data.preference=true",
          "objective=reward")  # a reward model trained one step on preference pairs
GRPO = ("data=prompts", "data.path=data/arithmetic_prompts.jsonl", "objective=grpo", "objective.reward=null",
        "objective.max_completion_tokens=4", "objective.num_generations=2")


def teacher_memory(args) -> dict:
    report: dict = {"processes": args.processes}
    with tempfile.TemporaryDirectory() as tmp:

        def trained(shape: str, *reward: str) -> Path:
            layers, width = (int(part) for part in shape.split("x"))
            run_dir = Path(tmp) / f"{'reward' if reward else 'teacher'}_{shape}"
            run([sys.executable, "train.py", f"model.n_layer={layers}", f"model.n_embd={width}", "model.n_head=8",
                 "model.block_size=32", "data.batch_size=2", "trainer.max_steps=1", "trainer.eval_every=0",
                 "trainer.eval_batches=1", "trainer.monitor=null", *reward, f"hydra.run.dir={run_dir}"])
            return run_dir

        def start_up_peaks(frozen: Path, name: str, objective: tuple[str, ...] = ("objective=distill",)) -> list[float]:
            run_dir = Path(tmp) / f"student_{name}"
            key = "objective.reward_model" if "objective=grpo" in objective else "objective.teacher"
            run([*launch("fsdp2", args.processes), *STUDENT, *objective, f"{key}={frozen}", f"hydra.run.dir={run_dir}"])
            return json.loads((run_dir / "summary.json").read_text())["peak_memory_gib"][
                "rss_per_rank_before_the_first_step"]

        baseline = start_up_peaks(trained("1x16") / "model", "tiny")
        reward_baseline = start_up_peaks(trained("1x16", *REWARD) / "model", "tiny_reward", GRPO)
        for shape in args.teachers:
            teacher = trained(shape)
            checkpoint = next((teacher / "checkpoints").iterdir())
            row = {"teacher_mib": round((teacher / "model" / "model.safetensors").stat().st_size / 2**20, 1)}
            for how, source in (("export, read in slices", teacher / "model"),
                                ("checkpoint, read whole by each rank", checkpoint)):
                peaks = start_up_peaks(source, f"{shape}_{how.split(',')[0]}")
                row[f"{how}: MiB per rank over a tiny teacher's run"] = [round(1024 * (p - b), 1) for p, b in
                                                                        zip(peaks, baseline)]
            report[f"teacher {shape}"] = row
            print(json.dumps({shape: row}), file=sys.stderr, flush=True)
            export = trained(shape, *REWARD) / "model"
            peaks = start_up_peaks(export, f"reward_{shape}", GRPO)
            row = {"reward_model_mib": round((export / "model.safetensors").stat().st_size / 2**20, 1),
                   "export, read in slices: MiB per rank over a tiny reward model's run": [
                       round(1024 * (p - b), 1) for p, b in zip(peaks, reward_baseline)]}
            report[f"reward model {shape}"] = row
            print(json.dumps({f"reward {shape}": row}), file=sys.stderr, flush=True)
    return report


def add_commands(commands) -> dict:
    c = commands.add_parser("teacher-memory", help="a distillation teacher's and a GRPO reward model's cost per "
                                                   "rank under FSDP2: read in slices vs whole")
    c.add_argument("--teachers", nargs="+", default=["24x512"], help="teacher sizes, layers x width (each is "
                   "trained for one step on this machine first: 24x1024 took over 15 minutes on 2 CPU cores)")
    c.add_argument("--processes", type=int, default=2)
    return {"teacher-memory": teacher_memory}

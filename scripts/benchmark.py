"""Is the template as fast and as exact as the alternatives? Sixteen benchmarks, one module each in
scripts/benchmarks/ (its docstring says what it compares and how both sides are measured); results in
scripts/BENCHMARKS.md.

    python scripts/benchmark.py parity [--processes 1 2] [overrides...]   # vs a hand-written loop
    python scripts/benchmark.py nanogpt --nanogpt DIR                     # vs karpathy/nanoGPT, same recipe
    python scripts/benchmark.py startup                                   # time to the first optimizer step
    python scripts/benchmark.py checkpoint                                # save MB/s vs a raw write
    python scripts/benchmark.py gpu --nanogpt DIR                         # one GPU: GPT-2-124M vs nanoGPT
    python scripts/benchmark.py stop-vote                                 # the per-step stop vote's cost
    python scripts/benchmark.py scale --sizes 10x640 16x1024              # memory per rank: DDP vs FSDP2
    python scripts/benchmark.py loss-memory                               # vocabulary 128k: chunked loss or not
    python scripts/benchmark.py packing                                   # packed documents vs padded: tokens/s
    python scripts/benchmark.py data                                      # token shards vs data=hf_dataset
    python scripts/benchmark.py preference                                # DPO: LoRA vs a reference copy, vs TRL
    python scripts/benchmark.py optimizers                                # muon vs adamw: loss at equal steps
    python scripts/benchmark.py schedules                                 # one WSD run's decays vs cosine runs
    python scripts/benchmark.py distill                                   # a student distilled vs the data alone
    python scripts/benchmark.py teacher-memory                            # FSDP2: a teacher, a reward model in slices
    python scripts/benchmark.py grpo                                      # GRPO: prompts together vs TRL
    python scripts/benchmark.py parity --device cuda --mixed-precision bf16 --peak-tflops 989 \
        model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=1024 data.batch_size=16

"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: src/ and scripts/benchmarks/
from scripts.benchmarks import (  # noqa: E402
    checkpoint,
    data,
    distill,
    gpu,
    grpo,
    loss_memory,
    nanogpt,
    optimizers,
    packing,
    parity,
    preference,
    scale,
    schedules,
    startup,
    stop_vote,
    teacher_memory,
)
from scripts.benchmarks.common import ROOT  # noqa: E402

BENCHMARKS = (parity, nanogpt, startup, checkpoint, gpu, stop_vote, scale, loss_memory, packing, data,
              preference, optimizers, schedules, distill, teacher_memory, grpo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    runs = {}
    for benchmark in BENCHMARKS:
        runs.update(benchmark.add_commands(commands))
    for name, command in commands.choices.items():
        if not name.startswith("_"):  # a worker (one side's process) is told its repeats by its benchmark
            once = ("gpu", "optimizers", "schedules", "distill")  # seeds, not repeats, give their spread
            command.add_argument("--repeats", type=int, default=1 if name in once else 3)
    commands.choices["_stop_vote"].add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.command.startswith("_"):  # a worker: it prints its own result
        runs[args.command](args)
        return
    Path(getattr(args, "dir", ROOT)).mkdir(parents=True, exist_ok=True)
    report = runs[args.command](args)
    print(json.dumps(report, indent=2))
    if args.command == "parity":  # the last line: what a script reads
        print(json.dumps({k: {"weights_equal": v["weights_equal"], "step_time_ratio": v["step_time_ratio"]}
                          for k, v in report.items()}))


if __name__ == "__main__":
    main()

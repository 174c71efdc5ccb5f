"""stop-vote: what the per-step stop-signal vote costs (src/faults/preemption.py) on several CPU processes.

A stand-in step of matrix products on each rank, timed without a vote, with the loop's asynchronous one and with
a blocking all-reduce in its place, alternating within one launch: the same ranks, the same clock.
"""

import json
import sys
import time
from statistics import median

from scripts.benchmarks.common import BENCHMARK, free_port, run


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
                  f"--master_port={free_port()}", str(BENCHMARK), "_stop_vote", f"--steps={args.steps}",
                  f"--size={args.size}", f"--repeats={args.repeats}"])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    base = report["none"]["ms_per_step"]
    for entry in report.values():
        entry["overhead_ms"] = round(entry["ms_per_step"] - base, 3)
    return {"processes": args.processes, **report}

def add_commands(commands) -> dict:
    """Its sub-commands of scripts/benchmark.py, and the function each runs."""
    v = commands.add_parser("stop-vote", help="the per-step stop-signal vote's cost on several CPU processes")
    v.add_argument("--processes", type=int, default=2)
    w = commands.add_parser("_stop_vote")  # its ranks, under torchrun
    for q in (v, w):
        q.add_argument("--steps", type=int, default=500)
        q.add_argument("--size", type=int, default=512, help="the stand-in step's square matrices")
    return {"stop-vote": stop_vote, "_stop_vote": stop_vote_worker}

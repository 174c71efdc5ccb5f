"""What this machine offers for training, and how to launch on it.

    python scripts/env_check.py          # a readable report
    python scripts/env_check.py --json   # the same as one JSON object, for scripts

Versions (Python, torch, accelerate, CUDA, cuDNN, NCCL), each GPU (name, memory, compute capability, bf16,
utilisation), CPU cores, the `accelerate config` default file and what it says, SLURM variables, and the
recommended launch command and precision for this machine.
"""

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gpus() -> list[dict]:
    import torch

    found = []
    utilisation = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            utilisation[i] = pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu
    except Exception:  # no NVML: utilisation unknown
        pass
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        found.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                      "compute_capability": f"{props.major}.{props.minor}", "bf16": props.major >= 8,
                      "utilization_percent": utilisation.get(i)})
    return found


def accelerate_default_config() -> dict:
    from accelerate.commands.config.config_args import default_config_file

    if not os.path.isfile(default_config_file):
        return {"path": default_config_file, "exists": False}
    import yaml

    with open(default_config_file, encoding="utf-8") as f:
        content = yaml.safe_load(f) or {}
    keys = ("distributed_type", "num_processes", "num_machines", "mixed_precision", "use_cpu", "gpu_ids")
    return {"path": default_config_file, "exists": True, **{k: content.get(k) for k in keys}}


def recommendation(gpu_list: list[dict], cores: int) -> dict:
    if not gpu_list:
        command = ("accelerate launch train.py" if cores < 4 else
                   f"accelerate launch --multi_gpu --num_processes 2 train.py  (CPU DDP over gloo; "
                   f"each process gets {cores // 2} threads)")
        return {"launch": command, "mixed_precision": "no (bf16 runs on CPU too, but is rarely faster there)"}
    precision = "bf16" if all(g["bf16"] for g in gpu_list) else "fp16"
    if len(gpu_list) == 1:
        command = "accelerate launch --config_file config/accelerate/single_gpu.yaml train.py"
    else:
        command = (f"accelerate launch --config_file config/accelerate/multi_gpu.yaml --num_processes "
                   f"{len(gpu_list)} train.py")
    return {"launch": f"{command} trainer.mixed_precision={precision}", "mixed_precision": precision}


def report() -> dict:
    import accelerate
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = torch.cuda.is_available()
    gpu_list = gpus() if cuda else []
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None,
        "gpus": gpu_list,
        "cpu_cores": cores,
        "accelerate_default_config": accelerate_default_config(),
        "slurm": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")},
        "recommended": recommendation(gpu_list, cores),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    facts = report()
    if parser.parse_args().json:
        print(json.dumps(facts))
        return
    print(f"Python {facts['python']}, torch {facts['torch']}, accelerate {facts['accelerate']}")
    print(f"CUDA {facts['cuda']}, cuDNN {facts['cudnn']}, NCCL {facts['nccl']}" if facts["cuda"] else "CUDA: none")
    for gpu in facts["gpus"]:
        print(f"  GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB, compute {gpu['compute_capability']}, "
              f"bf16 {'yes' if gpu['bf16'] else 'no'}, utilisation {gpu['utilization_percent']}%")
    print(f"CPU cores: {facts['cpu_cores']}")
    config = facts["accelerate_default_config"]
    if config["exists"]:
        said = ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("path", "exists"))
        print(f"accelerate config ({config['path']}): {said}")
    else:
        print(f"accelerate config: none ({config['path']}); the template needs none")
    print("SLURM: " + (", ".join(f"{k}={v}" for k, v in facts["slurm"].items()) or "not in a SLURM job"))
    print(f"Recommended: {facts['recommended']['launch']}\n  precision: {facts['recommended']['mixed_precision']}")


if __name__ == "__main__":
    main()

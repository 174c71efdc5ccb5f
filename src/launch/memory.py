"""What the model's state costs each rank, said before the first step: its weights, gradients and optimizer
state for the chosen layout, and, where that exceeds the memory a rank has, which layouts would fit, instead
of an out-of-memory error minutes later.

Activations are not counted (they depend on the batch, the sequence and activation checkpointing), so the
estimate is a floor: a run whose model state alone does not fit cannot train, one whose state fits may still
run out of memory in its activations. On CPU a rank's memory is the host's available memory, or what the job's
memory limit (its cgroup's: SLURM's --mem, a container's) leaves where that is less, shared by the machine's ranks.
"""

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from omegaconf import DictConfig

log = logging.getLogger(__name__)

# Optimizer state per trainable parameter, in copies of it: Adam's two moments, SGD's momentum buffer.
STATE_COPIES = {"adam": 2, "adamw": 2, "nadam": 2, "radam": 2, "adamax": 2, "sgd": 1, "rmsprop": 1, "adagrad": 1}


@dataclass
class ModelState:
    parameters: int
    weights: int  # bytes per rank
    gradients: int
    optimizer: Optional[int]  # None: an optimizer whose state this does not know
    shards: int  # 1, or the ranks the state is sharded over (FSDP)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + (self.optimizer or 0)

    def describe(self) -> str:
        optimizer = gib(self.optimizer) if self.optimizer is not None else "unknown"
        layout = f"sharded over {self.shards} ranks" if self.shards > 1 else "a whole copy on each rank"
        return (f"{gib(self.total)} per rank ({layout}): weights {gib(self.weights)}, gradients "
                f"{gib(self.gradients)}, optimizer state {optimizer}; activations come on top")


def gib(size: int) -> str:
    """A size in the unit that shows it: KiB, MiB or GiB."""
    for unit, power in (("GiB", 30), ("MiB", 20)):
        if size >= 2**power:
            return f"{size / 2**power:.2f} {unit}"
    return f"{size / 2**10:.1f} KiB"


def model_state(model: torch.nn.Module, optimizer_target: str, shards: int, momentum: float = 0.0) -> ModelState:
    """The bytes of the model's state on each rank, `shards` ranks sharing it (FSDP) or 1 (every rank whole)."""
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights once
    weights = sum(p.numel() * p.element_size() for p in unique)
    trainable = sum(p.numel() * p.element_size() for p in unique if p.requires_grad)
    name = optimizer_target.rsplit(".", 1)[-1].lower()
    copies = STATE_COPIES.get(name)
    if name == "sgd" and not momentum:
        copies = 0
    optimizer = None if copies is None else copies * trainable
    return ModelState(sum(p.numel() for p in unique), -(-weights // shards), -(-trainable // shards),
                      None if optimizer is None else -(-optimizer // shards), shards)


def memory_per_rank(device: torch.device) -> tuple[Optional[int], str]:
    """The memory one rank has and what it is: its GPU's, or the host's available memory shared by the ranks
    of this machine; (None, why) where it cannot be told."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index  # one GPU's device: "cuda"
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}'s memory"
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
    except OSError:
        return None, "unknown (no /proc/meminfo)"
    available = int(fields["MemAvailable"].split()[0]) * 1024
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    room = cgroup_memory_room()
    if room is not None and room < available:
        return room // ranks, f"what this job's memory limit (cgroup) leaves / {ranks} rank(s) on it"
    return available // ranks, f"the host's available memory / {ranks} rank(s) on it"


def cgroup_memory_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                       ) -> Optional[int]:
    """The bytes this process's memory cgroup and its ancestors (a SLURM job's limit sits above its steps') may
    still use, the tightest of them: cgroup v2's memory.max - memory.current, or v1's memory.limit_in_bytes -
    memory.usage_in_bytes. None where none is limited or there is no cgroup file system."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, its files named memory.max and memory.current
            mount, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            mount, limit_file, usage_file = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        group = mount / path.lstrip("/")
        if not group.is_dir():  # a container sees its own cgroup as the mount's root
            group = mount
        while True:
            try:
                limit = (group / limit_file).read_text().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as a huge number
                    rooms.append(int(limit) - int((group / usage_file).read_text()))
            except (OSError, ValueError):
                pass
            if group == mount:
                break
            group = group.parent
    return max(0, min(rooms)) if rooms else None


def what_would_fit(state: ModelState, available: int, world_size: int, precision: str) -> str:
    """The warning for a model state larger than a rank's memory, naming the layouts that would fit."""
    ways = []
    if state.shards == 1:
        ways.append(f"FSDP2 (config/accelerate/fsdp.yaml): the state sharded over {world_size} ranks would be "
                    f"{gib(state.total // world_size)} each" if world_size > 1 else
                    "FSDP2 over several ranks (config/accelerate/fsdp.yaml): the state is divided among them")
    else:
        needed = -(-state.total * state.shards // available)
        each = gib(state.total * state.shards // needed)
        ways.append(f"more ranks: sharded over {needed} or more, each would hold {each}")
    if precision != "bf16":
        ways.append("trainer.mixed_precision=bf16 halves the activations (the state stays fp32)")
    ways.append("activation checkpointing (config/accelerate/fsdp.yaml: fsdp_activation_checkpointing) and a "
                "smaller data.batch_size lower the activations on top")
    return (f"the model's state needs {gib(state.total)} per rank but a rank has {gib(available)}: this run will "
            "run out of memory. What would fit: " + "; ".join(ways))


def state_of_run(accelerator: Accelerator, model: torch.nn.Module, cfg: DictConfig) -> ModelState:
    """The model state per rank of this run's layout: FSDP shards it over every rank, DDP copies it whole."""
    shards = accelerator.num_processes if accelerator.distributed_type == DistributedType.FSDP else 1
    return model_state(accelerator.unwrap_model(model), cfg.optimizer._target_, shards,
                       cfg.optimizer.get("momentum") or 0.0)


def warn_if_it_cannot_fit(accelerator: Accelerator, model: torch.nn.Module, cfg: DictConfig) -> None:
    """Before anything is placed on the device: a warning naming what would fit, where the state cannot."""
    state = state_of_run(accelerator, model, cfg)
    available, _ = memory_per_rank(accelerator.device)
    if available is not None and state.total > available and accelerator.is_local_main_process:
        log.warning(what_would_fit(state, available, accelerator.num_processes, str(cfg.trainer.mixed_precision)))

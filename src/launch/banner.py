"""The banner at the top of train.log: what was launched, where, and why each setting has its value."""

import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import DictConfig

from src.launch.memory import gib, memory_per_rank, state_of_run
from src.launch.settings import LaunchSettings
from src.launcher import launched_world_size


def describe_launch(accelerator: Accelerator, cfg: DictConfig, settings: LaunchSettings, run_dir: Path,
                    model: torch.nn.Module) -> str:
    per_process = cfg.data.get("batch_size", "?")
    accumulation = settings.gradient_accumulation_steps.value
    rows = {
        "run dir": run_dir,
        "processes": f"{accelerator.num_processes} ({accelerator.num_processes // max(1, _nodes())} per node, "
        f"{_nodes()} node(s))",
        "distributed type": accelerator.distributed_type,
        "device": f"{accelerator.device} ({torch.get_num_threads()} CPU threads per process)"
        if accelerator.device.type == "cpu" else accelerator.device,
        "mixed precision": f"{accelerator.mixed_precision} ({settings.mixed_precision.source})",
        "deterministic kernels": torch.are_deterministic_algorithms_enabled(),
        "torch.compile": f"the training step (mode {cfg.trainer.compile_mode}) and evaluation"
        if cfg.trainer.compile else "off",
        "gradient accumulation steps": f"{accumulation} ({settings.gradient_accumulation_steps.source})",
        "batch size per process": per_process,
        "global batch size": f"{per_process * accelerator.num_processes * accumulation} "
        f"(= {per_process} per process x {accelerator.num_processes} processes x {accumulation} micro-steps)"
        if isinstance(per_process, int) else "?",
        "optimizer steps": cfg.trainer.max_steps,
        "model": cfg.model._target_ + (f" (started from the weights of {cfg.trainer.init_weights})"
                                       if cfg.trainer.get("init_weights") else ""),
        "parameters": _parameters(accelerator.unwrap_model(model)),
        "model state": state_of_run(accelerator, model, cfg).describe(),
        "memory per rank": _memory(accelerator),
        "data": cfg.data._target_,
        "objective": cfg.objective._target_,
        "command": " ".join(sys.argv),
    }
    width = max(map(len, rows))
    return "\n".join(["=" * 80] + [f"{k:<{width}} : {v}" for k, v in rows.items()] + ["=" * 80])


def _parameters(model: torch.nn.Module) -> str:
    """All and trainable: a LoRA adapter (model.peft) trains a small fraction of the model."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{total:,} ({trainable:,} trainable, {100 * trainable / max(total, 1):.2f}%)"


def _memory(accelerator: Accelerator) -> str:
    available, what = memory_per_rank(accelerator.device)
    return f"{gib(available)} ({what})" if available is not None else what


def _nodes() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return launched_world_size() // local if local else 1

"""What the launch asked for: process counts, precision and accumulation from `accelerate launch`'s flags
or config file, the environment of torchrun/srun, or the config; each setting remembers where it came from.
"""

import argparse
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from src.errors import UsageError
from src.launch.precision import resolve_precision
from src.launcher import launched_world_size, launcher_config_file, parent_launch_args


@dataclass
class Setting:
    value: Any
    source: str  # where the value came from, for the banner: config, launcher, environment or default


@dataclass
class LaunchSettings:
    mixed_precision: Setting
    gradient_accumulation_steps: Setting
    requested_processes: Setting


def launch_settings(trainer: DictConfig) -> LaunchSettings:
    """The effective precision and accumulation, each from the config if it sets one, else from the launcher
    (`accelerate launch --mixed_precision`, the `accelerate config` file, `--config_file`), else the default.
    A config value that contradicts an explicit launcher value is refused, naming both."""
    args = parent_launch_args()
    path, file = launcher_config_file(args) if args else (None, {})
    in_file = f"config file {path}"
    if args is not None:
        launcher_precision = (Setting(args.mixed_precision, "launcher: --mixed_precision") if args.mixed_precision
                              else Setting(file["mixed_precision"], f"launcher: {in_file}")
                              if file.get("mixed_precision") is not None else None)
        file_accumulation = (file.get("deepspeed_config") or {}).get("gradient_accumulation_steps")
        launcher_accumulation = (
            Setting(args.gradient_accumulation_steps, "launcher: --gradient_accumulation_steps")
            if args.gradient_accumulation_steps else Setting(file_accumulation, f"launcher: {in_file}")
            if file_accumulation is not None else None)
    else:  # python / torchrun: the variables accelerate's launcher would have set, if the user set them
        env_precision, env_accumulation = (os.environ.get(f"ACCELERATE_{k}") for k in
                                           ("MIXED_PRECISION", "GRADIENT_ACCUMULATION_STEPS"))
        launcher_precision = Setting(env_precision, "environment: ACCELERATE_MIXED_PRECISION") if env_precision else None
        launcher_accumulation = (Setting(int(env_accumulation), "environment: ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
                                 if env_accumulation else None)
    configured_precision = trainer.mixed_precision
    if configured_precision == "auto" and launcher_precision is not None:
        configured_precision = None  # auto defers to a precision the launcher names
    precision = _decide("trainer.mixed_precision", configured_precision, launcher_precision, "no")
    settings = LaunchSettings(
        mixed_precision=Setting(*resolve_precision(precision.value, precision.source)),
        gradient_accumulation_steps=_decide("trainer.gradient_accumulation_steps",
                                            trainer.gradient_accumulation_steps, launcher_accumulation, 1),
        requested_processes=requested_processes(args, path, file),
    )
    if settings.mixed_precision.value == "fp16" and not torch.cuda.is_available():
        raise UsageError(f"mixed precision fp16 ({settings.mixed_precision.source}) needs a CUDA GPU: on CPU "
                         "accelerate would silently train in fp32. Use bf16 or no.")
    return settings


def _decide(key: str, configured: Any, launcher: Optional[Setting], default: Any) -> Setting:
    if configured is not None and launcher is not None and str(configured) != str(launcher.value):
        raise UsageError(
            f"{key}={configured} (config) contradicts {launcher.value} ({launcher.source}). Keep one: "
            f"pass {key}=null to use the launcher's value, or launch with the value the config asks for."
        )
    if configured is not None:
        return Setting(configured, f"config: {key}")
    return launcher if launcher is not None else Setting(default, "default")


def needs_cpu_flag() -> bool:
    """Without CUDA, torchrun/--multi_gpu workers only form a process group (gloo, MULTI_CPU) with cpu=True;
    a single process keeps accelerate's own device choice (e.g. Apple MPS)."""
    return not torch.cuda.is_available() and launched_world_size() > 1


def requested_processes(args: Optional[argparse.Namespace], path: Optional[str], file: dict) -> Setting:
    """How many processes the launcher was asked for: --num_processes, else its config file's answer."""
    if args is None:
        return Setting(1, "default")
    if args.num_processes:
        return Setting(args.num_processes, "launcher: --num_processes")
    return Setting(file.get("num_processes") or 1, f"launcher: config file {path}")

"""What the launcher said: this process's rank and the world size as its launcher numbered them, and the
arguments and config file of the `accelerate launch` that started it. A leaf: it imports nothing of ours, so
any module may ask it, before any process group or Accelerator exists.
"""

import argparse
import functools
import os
from pathlib import Path
from typing import Optional

import yaml


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank as its launcher numbered it, before any process group exists (0 for a plain
    `python train.py`)."""
    return int(os.environ.get("RANK", "0"))


@functools.cache
def parent_launch_args() -> Optional[argparse.Namespace]:
    """The arguments of the `accelerate launch` that started this process, parsed by accelerate's own parser,
    or None when something else started it. (The launcher exports no variable for most of what it was asked:
    e.g. `--num_processes N` without CUDA starts one process, and `--gradient_accumulation_steps` reaches the
    script only under DeepSpeed.)"""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or no /proc
        return None
    # `accelerate launch ARGS` or `python -m accelerate.commands.launch ARGS`
    starts = [i for i, a in enumerate(argv[:4]) if a == "accelerate.commands.launch"
              or (a == "launch" and i > 0 and argv[i - 1].endswith("accelerate"))]
    if not starts:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        return launch_command_parser().parse_args([a for a in argv[starts[0] + 1:] if a != ""])
    except SystemExit:  # not parseable after all: treat as unknown
        return None


def launcher_config_file(args: argparse.Namespace) -> tuple[Optional[str], dict]:
    """The config file the launcher read (`--config_file`, else the `accelerate config` default) and its
    contents, as accelerate itself chooses it."""
    from accelerate.commands.config.config_args import default_config_file

    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) and not args.cpu else None)
    if path is None or not os.path.isfile(path):
        return None, {}
    with open(path, encoding="utf-8") as f:
        return path, yaml.safe_load(f) or {}

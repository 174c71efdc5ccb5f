"""The configuration schema: every key, its type, its allowed range and what it means, in one place.

Hydra composes the YAML files under config/ on top of these dataclasses (each YAML's defaults list names
its schema), so an unknown key or a wrong type fails during composition. Ranges are declared here in each
field's metadata and checked by `ValidateConfig`, a Hydra callback that runs before Hydra creates the run
directory, so a bad value never leaves an empty run dir behind.
"""

import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.distributed import TCPStore


def setting(default: Any, help: str, **bounds: float) -> Any:
    """A schema field with its meaning and its bounds (ge, gt, le, lt), checked by `validate`."""
    return field(default=default, metadata={"help": help, **bounds})


class MixedPrecision(Enum):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"


class MonitorMode(Enum):
    min = "min"
    max = "max"


class TextLevel(Enum):
    char = "char"
    byte = "byte"


@dataclass
class TrainerConfig:
    max_steps: int = setting(2000, "optimizer steps to train for", ge=1)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", ge=1)
    mixed_precision: MixedPrecision = setting(MixedPrecision.no, "autocast dtype: no | fp16 | bf16")
    seed: int = setting(1337, "seed for model init, data order, dropout", ge=0)
    log_every: int = setting(10, "optimizer steps between train/* scalars", ge=1)
    eval_every: int = setting(250, "optimizer steps between evaluations (0: only at the end)", ge=0)
    checkpoint_every: int = setting(500, "optimizer steps between checkpoints (0: only at the end)", ge=0)
    keep_last_checkpoints: int = setting(3, "newest complete checkpoints kept on disk", ge=2)
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to this (0: no clipping)", ge=0)
    monitor: Optional[str] = setting(None, "metric that picks the best checkpoint, e.g. eval/loss")
    monitor_mode: MonitorMode = setting(MonitorMode.min, "whether the monitored metric is better low or high")
    dist_timeout_s: int = setting(1800, "collective timeout: a lost peer ends the run with an error", ge=1)
    compile: bool = setting(False, "torch.compile the model")
    cpu_threads: Optional[int] = setting(None, "intra-op threads per process on CPU (null: its share of the cores)", ge=1)


# --- model options -------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    _target_: str = "src.models.gpt.GPT"
    block_size: int = setting(64, "context length in tokens", ge=1)
    n_layer: int = setting(4, "transformer blocks", ge=1)
    n_head: int = setting(4, "attention heads (must divide n_embd)", ge=1)
    n_embd: int = setting(128, "embedding width", ge=1)
    dropout: float = setting(0.0, "dropout probability", ge=0, lt=1)
    bias: bool = setting(False, "biases in Linear and LayerNorm layers")


@dataclass
class ResNetConfig:
    _target_: str = "src.models.resnet.ResNet"
    width: int = setting(16, "channels of the first stage (doubled per stage)", ge=1)
    blocks_per_stage: int = setting(2, "basic blocks in each of the 3 stages", ge=1)


# --- data options ---------------------------------------------------------------------------------------


@dataclass
class LoaderConfig:
    batch_size: int = setting(32, "samples per process per micro-step", ge=1)
    num_workers: int = setting(0, "DataLoader worker processes per training process", ge=0)


@dataclass
class TokenStreamConfig(LoaderConfig):
    """What both language-model datasets share: a token stream cut into windows, its tail validating."""

    block_size: int = setting("${model.block_size}", "tokens per sample", ge=1)
    val_fraction: float = setting(0.1, "tail of the file used for validation", gt=0, lt=1)


@dataclass
class TextDataConfig(TokenStreamConfig):
    _target_: str = "src.data.text.TextData"
    path: str = setting(MISSING, "UTF-8 text file")
    level: TextLevel = setting(TextLevel.char, "tokens are characters (vocab from the file) or bytes (256)")


@dataclass
class TokenDataConfig(TokenStreamConfig):
    _target_: str = "src.data.text.TokenData"
    path: str = setting(MISSING, "flat uint16 token-id file (nanoGPT's .bin format)")
    vocab_size: int = setting(MISSING, "number of distinct token ids", ge=1, le=65536)


@dataclass
class Cifar10DataConfig(LoaderConfig):
    _target_: str = "src.data.cifar10.Cifar10Data"
    root: str = setting(MISSING, "directory with data_batch_*.bin and test_batch.bin")
    augment: bool = setting(True, "random crop + flip on training images")
    num_classes: int = setting(10, "number of labels", ge=2)
    seed: int = setting("${trainer.seed}", "seed of the augmentation (with epoch and sample index)", ge=0)


# --- optimizer and scheduler options (built with _partial_, then given params / the optimizer) -----------


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    _convert_: str = "all"  # betas reach torch as a plain list, not a ListConfig
    lr: float = setting(1e-3, "peak learning rate", gt=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = setting(0.1, "decoupled weight decay on matrices (not biases/norms)", ge=0)
    eps: float = setting(1e-8, "Adam epsilon", gt=0)
    fused: Optional[bool] = setting(None, "fused CUDA kernel (None: PyTorch decides)")


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = setting(0.1, "peak learning rate", gt=0)
    momentum: float = setting(0.9, "momentum", ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = setting(5e-4, "L2 penalty on matrices (not biases/norms)", ge=0)


@dataclass
class WarmupCosineConfig:
    _target_: str = "src.schedule.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = setting(100, "optimizer steps of linear warm-up", ge=0)
    total_steps: int = setting("${trainer.max_steps}", "optimizer steps the cosine spans", ge=1)
    min_lr_ratio: float = setting(0.1, "final LR as a fraction of optimizer.lr", ge=0, le=1)


@dataclass
class ConstantConfig:
    _target_: str = "src.schedule.constant"
    _partial_: bool = True
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up", ge=0)


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resume: Optional[str] = setting(None, "null (fresh run), auto (newest checkpoint in the run dir) or a path")


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, name, node in [
        ("model", "gpt", GPTConfig),
        ("model", "resnet", ResNetConfig),
        ("data", "text", TextDataConfig),
        ("data", "tokens", TokenDataConfig),
        ("data", "cifar10", Cifar10DataConfig),
        ("optimizer", "adamw", AdamWConfig),
        ("optimizer", "sgd", SGDConfig),
        ("scheduler", "warmup_cosine", WarmupCosineConfig),
        ("scheduler", "constant", ConstantConfig),
    ]:
        # The YAML option of the same name lists "<name>_schema" first in its defaults.
        cs.store(group=group, name=f"{name}_schema", node=node)


# --- range validation -----------------------------------------------------------------------------------


class UsageError(CompactHydraException):
    """A mistake of the user's, not a bug: Hydra prints it as its message alone (no traceback), exit status 1."""


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def range_errors(node: DictConfig, prefix: str = "") -> list[str]:
    """Every bound declared in the schema that the composed config breaks, as 'full.key=value: must be ...'."""
    errors = []
    schema = OmegaConf.get_type(node)
    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for key in node.keys():
        full_key = f"{prefix}{key}"
        value = node[key]  # resolves interpolations, e.g. data.block_size=${model.block_size}
        if isinstance(value, DictConfig):
            errors += range_errors(value, f"{full_key}.")
            continue
        meta = fields[key].metadata if key in fields else {}
        for bound, (symbol, holds) in _BOUNDS.items():
            if bound in meta and value is not None and not holds(value, meta[bound]):
                allowed = " and ".join(f"{_BOUNDS[b][0]} {meta[b]}" for b in _BOUNDS if b in meta)
                errors.append(f"{full_key}={value} is out of range: must be {allowed} ({meta['help']})")
    return errors


def config_errors(cfg: DictConfig) -> list[str]:
    groups = [(key, cfg[key]) for key in cfg if key != "hydra" and isinstance(cfg[key], DictConfig)]
    errors = [error for key, node in groups for error in range_errors(node, f"{key}.")]
    if OmegaConf.select(cfg, "trainer.mixed_precision") == MixedPrecision.fp16:
        if not torch.cuda.is_available():
            errors.append("trainer.mixed_precision=fp16 needs a CUDA GPU (on CPU accelerate would silently run "
                          "fp32): use bf16 or no")
    return errors


class ValidateConfig(Callback):
    """Rejects out-of-range values before Hydra creates the run directory (on_run_start precedes it)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._exit_on_errors(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._exit_on_errors(config)

    @staticmethod
    def _exit_on_errors(config: DictConfig) -> None:
        errors = config_errors(config)
        if errors:
            print("Invalid configuration:\n  " + "\n  ".join(errors), file=sys.stderr)
            # Hydra turns a callback's exceptions into warnings and carries on; SystemExit is not an Exception.
            raise SystemExit(1)


# --- a run directory every rank agrees on ---------------------------------------------------------------


@functools.cache
def shared_timestamp() -> str:
    """This launch's start time, the same string on every rank of a torchrun / accelerate launch.

    Each rank runs @hydra.main itself, so `${now:}` could name a different directory per rank. Under the
    torch elastic agent (torchrun, `accelerate launch --multi_gpu`) every worker can reach the agent's
    key-value store at MASTER_ADDR:MASTER_PORT: the first rank to get there writes its timestamp, and
    everyone (including a restarted worker of the same launch) reads that one.
    """
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return stamp
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("MASTER_PORT") in (None, "0"):
        raise UsageError(
            "This multi-process launch has no shared store to agree on a timestamped run directory: "
            "pass hydra.run.dir=PATH (the same on every process)."
        )
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=30))
    return store.compare_set("template/run_timestamp", "", stamp).decode()


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("shared_timestamp", shared_timestamp, use_cache=True, replace=True)


register_configs()
register_resolvers()

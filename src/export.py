"""The trained model as plain files, loadable without accelerate, Hydra's run or this repo's trainer.

<dir>/model.safetensors  weights (tied weights stored once)
<dir>/config.yaml        the model config with `_target_`, including what the data decided (vocab_size, ...)
"""

from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_model


def model_config(model_cfg: DictConfig, model_kwargs: dict[str, Any]) -> DictConfig:
    """The config that rebuilds this exact architecture on its own."""
    return OmegaConf.merge(OmegaConf.to_container(model_cfg, resolve=True), model_kwargs)


def export_model(accelerator, model: torch.nn.Module, config: DictConfig, directory: Path) -> None:
    """Main process only writes; every process must call it (unwrapping may gather sharded weights)."""
    accelerator.save_model(model, directory, safe_serialization=True)
    if accelerator.is_main_process:
        OmegaConf.save(config, Path(directory) / "config.yaml")


def load_exported_model(directory: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    directory = Path(directory)
    for name in ("config.yaml", "model.safetensors"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing: not an exported model directory")
    model = instantiate(OmegaConf.load(directory / "config.yaml"))
    load_model(model, directory / "model.safetensors", strict=True, device=str(device))
    return model.to(device).eval()

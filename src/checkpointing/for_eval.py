"""A checkpoint's or exported model's config and model, rebuilt without its data (for eval.py)."""

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.checkpointing.integrity import check_readable
from src.checkpointing.layout import CONFIG_FILE, RUN_CONFIG
from src.checkpointing.load import model_must_fit
from src.checkpointing.training_state import checked_base_weights, load_whole_weights
from src.errors import UsageError
from src.schema.trusted import check_targets


def run_config_for(path: Path, trusted: set[str] = frozenset()) -> DictConfig:
    """The training config that produced an exported model or checkpoint (for eval.py); a checkpoint is checked
    whole first (integrity.check_readable), before its config is read, and the config's targets are checked
    against config/ and `trusted` (those eval.py's command line names) before anything of it is built."""
    if (path / CONFIG_FILE).is_file():
        check_readable(path)
    for candidate in (path / CONFIG_FILE, path.parent / RUN_CONFIG, path.parent.parent / RUN_CONFIG):
        if candidate.is_file():
            cfg = OmegaConf.load(candidate)
            if "data" in cfg:
                check_targets(cfg, str(candidate), trusted, accept="+{key}={value}")
                return cfg
    raise UsageError(f"path={path}: no training config found (looked for {CONFIG_FILE} in it and "
                     f"{RUN_CONFIG} in its run dir)")


def load_checkpointed_model(checkpoint: Path, run_cfg: DictConfig) -> torch.nn.Module:
    """The model of a checkpoint run_config_for has checked, rebuilt from its run's config alone (data-derived
    sizes are saved resolved)."""
    model = instantiate(run_cfg.model, _convert_="all")
    without_frozen = checked_base_weights(checkpoint, model)  # weights left out: model.pretrained's, read just now
    with model_must_fit(f"checkpoint {checkpoint}"):
        load_whole_weights(model, checkpoint, without_frozen)
    return model.eval()

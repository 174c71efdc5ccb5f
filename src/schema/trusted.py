"""A config read from a checkpoint or an export is data: the only callables it may name are the ones this
repository's config groups name, or the ones the user names for this run.

Hydra's `instantiate` calls whatever `_target_` names. Its blocklist stops `exec` and `os.system`, not
`torch.load(weights_only=False)`, `pickle.loads`, `numpy.load(allow_pickle=True)`, `subprocess.run` or a package's
own loader; so a checkpoint someone hands you, whose `run_config.yaml` names one of those, would run their code
however free of pickles its files are. Every `_target_` of such a config is therefore checked, before anything of
it is imported or built, against the targets of `config/**/*.yaml` (a user's own option lives there too) and of
the config this run's command line composed (where `model._target_=my.Model` names one deliberately).
Interpolations are refused outright where they could build a node (`oc.create`, `oc.decode`): a saved config
is resolved, so a checkpoint of ours holds none.
"""

import functools
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.errors import UsageError

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "config"
TARGET = "_target_"
# Resolvers that turn a string into config nodes (a `_target_` the walk below would not see) or read another
# file's contents; none appears in a config this template saves.
NODE_BUILDING = re.compile(r"\$\{\s*oc\.(create|decode)\s*:")


@functools.cache
def offered_targets(root: Path = CONFIG_ROOT) -> frozenset[str]:
    """Every `_target_` that a YAML file of the config groups names (read as plain YAML: nothing is composed)."""
    found = set()
    for file in sorted(root.rglob("*.yaml")):
        for document in yaml.safe_load_all(file.read_text(encoding="utf-8")):
            found.update(value for _, value in _targets(document) if isinstance(value, str))
    return frozenset(found)


def targets_in(cfg: Any) -> list[tuple[str, Any]]:
    """(full key, value) of every `_target_` in a config, at any depth, lists included; unresolved."""
    plain = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, (DictConfig, ListConfig)) else cfg
    return list(_targets(plain))


def check_targets(cfg: Any, source: str, trusted: Iterable[str] = (), accept: str = "{key}={value}") -> None:
    """Refuses, before anything is built, a config from `source` (a checkpoint's or an export's file) whose
    `_target_`s are not all offered by config/ or `trusted` (those of the config this run's command line composed).
    `accept`: the override that names a target deliberately, as the program takes it ({key}, {value})."""
    allowed = offered_targets() | set(trusted)
    refused = [(key, value) for key, value in targets_in(cfg) if not isinstance(value, str) or value not in allowed]
    if refused:
        named = ", ".join(f"{key}={value}" for key, value in refused)
        accepts = " ".join(accept.format(key=key, value=value) for key, value in refused)
        raise UsageError(
            f"{source} names {named}: not a component this repository's config groups (config/**/*.yaml) offer nor "
            "one this command line names. Refused, nothing of it was imported or built: a config from a checkpoint "
            "or an export is data, and a `_target_` can name any callable (torch.load, pickle.loads, subprocess.run "
            f"...). If you trust {source} and what it names, name it for this run: {accepts}")
    for key, value in _strings(OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg):
        if NODE_BUILDING.search(value):
            raise UsageError(f"{source} has {key}={value}: an interpolation that builds config nodes from a "
                             "string, which a config this template saves never holds: refused, nothing was built")


def trusted_by(cfg: Any) -> set[str]:
    """The targets of the config this run composed (its groups' YAML and its command line's overrides)."""
    return {value for _, value in targets_in(cfg) if isinstance(value, str)}


def _targets(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in _children(node):
        if key == TARGET:
            yield f"{prefix}{key}", value
        else:
            yield from _targets(value, f"{prefix}{key}.")


def _strings(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in _children(node):
        if isinstance(value, str):
            yield f"{prefix}{key}", value
        else:
            yield from _strings(value, f"{prefix}{key}.")


def _children(node: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(node, dict):
        yield from node.items()
    elif isinstance(node, list):
        yield from enumerate(node)

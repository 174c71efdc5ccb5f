"""Sizes only the data knows (`vocab_size`, `num_classes`, ...) enter a config as `${dataset:NAME}`.

They stay unresolved while the config is completed and checked, and are written in once the data is built
(`resolve_data_sizes`), so config.yaml and checkpoints hold the numbers. The `dataset` resolver itself only ever
refuses: the sizes are substituted into the config's text, not looked up by OmegaConf, so nothing here keeps state.
"""

import re
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from src.errors import ConfigError

DATA_SIZE = re.compile(r"\$\{dataset:(\w+)\}")


class DataSizeUnknown(Exception):
    pass


def _dataset_resolver(name: str) -> int:
    raise DataSizeUnknown(f"${{dataset:{name}}} is known once the data is built")


OmegaConf.register_new_resolver("dataset", _dataset_resolver, replace=True)


def data_size_references(node: Any, path: str) -> list[tuple[str, str]]:
    """(full key, size name) of every `${dataset:NAME}` under a node, nested ones included."""
    found = []
    container = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
    if isinstance(container, dict):
        for key, value in container.items():
            found += data_size_references(value, f"{path}.{key}")
    elif isinstance(container, list):
        for i, value in enumerate(container):
            found += data_size_references(value, f"{path}[{i}]")
    elif isinstance(container, str):
        found += [(path, name) for name in DATA_SIZE.findall(container)]
    return found


def _substituted(node: Any, value_of: Callable[[str], Any]) -> Any:
    """A plain container with every `${dataset:NAME}` replaced by value_of(NAME): a value where it is the whole
    string, its text where it is part of one."""
    if isinstance(node, dict):
        return {key: _substituted(value, value_of) for key, value in node.items()}
    if isinstance(node, list):
        return [_substituted(value, value_of) for value in node]
    if isinstance(node, str):
        whole = DATA_SIZE.fullmatch(node)
        return value_of(whole.group(1)) if whole else DATA_SIZE.sub(lambda m: str(value_of(m.group(1))), node)
    return node


def resolve_data_sizes(cfg: DictConfig, sizes: dict[str, int]) -> DictConfig:
    """The config with every `${dataset:NAME}` replaced by the built data's value (and everything else resolved)."""
    missing = [(key, name) for key, name in data_size_references(cfg, "") if name not in sizes]
    if missing:
        raise ConfigError([f"{key[1:]}=${{dataset:{name}}}, but the data provides only: "
                           f"{', '.join(sorted(sizes)) or 'no sizes'}" for key, name in missing])
    with_sizes = OmegaConf.create(_substituted(OmegaConf.to_container(cfg, resolve=False), sizes.__getitem__))
    return OmegaConf.create(OmegaConf.to_container(with_sizes, resolve=True))


def resolved_but_data_sizes(cfg: DictConfig, **options) -> Any:
    """The config as a plain container, resolved except that each `${dataset:NAME}` stays its own text: for
    comparing configs before the data is built."""
    as_text = _substituted(OmegaConf.to_container(cfg, resolve=False), lambda name: f"\\${{dataset:{name}}}")
    return OmegaConf.to_container(OmegaConf.create(as_text), resolve=True, **options)

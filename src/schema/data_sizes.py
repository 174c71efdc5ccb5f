"""Sizes only the data knows (`vocab_size`, `num_classes`, ...) enter a config as `${dataset:NAME}`.

They stay unresolved while the config is completed and checked, and are resolved once the data is built
(`resolve_data_sizes`), so config.yaml and checkpoints hold the numbers.

Module state: `_data_sizes`, what OmegaConf's resolver callback answers, set only inside resolve_data_sizes and
data_sizes_unresolved (a resolver is registered once per process and takes no arguments but the name).
"""

import contextlib
import re
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from src.errors import ConfigError

DATA_SIZE = re.compile(r"\$\{dataset:(\w+)\}")


class DataSizeUnknown(Exception):
    pass


_data_sizes: Optional[dict[str, int]] = None


def _dataset_resolver(name: str) -> int:
    if _data_sizes is None:
        raise DataSizeUnknown(f"${{dataset:{name}}} is known once the data is built")
    return _data_sizes[name]


OmegaConf.register_new_resolver("dataset", _dataset_resolver, replace=True)


class _Placeholders(dict):
    def __missing__(self, name: str) -> str:
        return f"${{dataset:{name}}}"


@contextlib.contextmanager
def data_sizes_unresolved():
    """Within it, `${dataset:NAME}` resolves to its own text: for comparing configs before the data is built."""
    global _data_sizes
    _data_sizes = _Placeholders()
    try:
        yield
    finally:
        _data_sizes = None


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


def resolve_data_sizes(cfg: DictConfig, sizes: dict[str, int]) -> DictConfig:
    """The config with every `${dataset:NAME}` replaced by the built data's value (and everything else resolved)."""
    global _data_sizes
    missing = [(key, name) for key, name in data_size_references(cfg, "") if name not in sizes]
    if missing:
        raise ConfigError([f"{key[1:]}=${{dataset:{name}}}, but the data provides only: "
                           f"{', '.join(sorted(sizes)) or 'no sizes'}" for key, name in missing])
    _data_sizes = dict(sizes)
    try:
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    finally:
        _data_sizes = None

"""Building a component from its config node."""

from typing import Any

from omegaconf import DictConfig

from src.errors import UsageError


def build(node: DictConfig, *args: Any, group: str, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with a mistake of the user's (a missing file, a bad value found while building)
    reported as itself, naming the group, rather than inside Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, *args, _convert_="all", **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, UsageError):
            raise cause from None
        if isinstance(cause, (FileNotFoundError, IsADirectoryError, PermissionError, ValueError)):  # bad input
            raise UsageError(f"{group} ({node.get('_target_')}): {cause}") from None
        raise

"""The configuration machinery: a component's signature is its schema (signature.py); the run's config is
completed and checked before anything is built (complete.py, trainer.py, hydra_hooks.py).

What your own components need is importable from here: `Arg` to document and bound a parameter, `UsageError`
(and `ConfigError`) for input that is wrong, `build` to instantiate a nested component.
"""

from src.schema.build import build
from src.schema.errors import ConfigError, UsageError
from src.schema.signature import Arg

__all__ = ["Arg", "ConfigError", "UsageError", "build"]

"""The configuration machinery: a component's signature is its schema (signature.py); the run's config is
completed and checked before anything is built (complete.py, trainer.py; src/launch/hydra_hooks.py runs
the check inside Hydra).

What your own components need is importable from here: `Arg` to document and bound a parameter, `UsageError`
(and `ConfigError`) for input that is wrong, `build` to instantiate a nested component.
"""

from src.errors import ConfigError, UsageError
from src.schema.build import build
from src.schema.signature import Arg

__all__ = ["Arg", "ConfigError", "UsageError", "build"]

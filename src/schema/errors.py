"""The errors that mean "your input is wrong": printed as a message alone, exit status 1."""

from hydra.errors import CompactHydraException


class UsageError(CompactHydraException):
    """A mistake of the user's, not a bug: Hydra prints it as its message alone (no traceback), exit status 1."""


class ConfigError(UsageError):
    """Everything wrong with a configuration, one line per problem, each naming its full key."""

    def __init__(self, problems: list[str]):
        super().__init__("Invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems

"""A component's signature is its configuration schema: one home for every default, type, range and help text.

A config group node (`model`, `data`, `optimizer`, `scheduler`, `objective`) names a callable with `_target_`;
its parameters are the node's keys. Their defaults, types and bounds are read from the signature, so a value
is written once, beside the code it configures:

    class GPT(nn.Module):
        def __init__(self, vocab_size: int, n_layer: Annotated[int, Arg("transformer blocks", ge=1)] = 4): ...

`complete(node, target, path)` fills the defaults in and reports every unknown key (with a suggestion), wrong
type, out-of-range value and missing mandatory value, naming the full key. Values a YAML file or the command
line sets are checked the same way. A dataclass (the trainer's settings) is a signature too.

Sizes only the data knows (`vocab_size`, `num_classes`, ...) enter the model config as `${dataset:NAME}`,
anywhere in it; they are resolved once the data is built (`resolve_data_sizes`) and saved resolved.
"""

import contextlib
import difflib
import importlib
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Union

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

# Keys Hydra's instantiate reads; they are not parameters of the target.
INSTANTIATE_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
DATA_SIZE = re.compile(r"\$\{dataset:(\w+)\}")
BOUND_HOLDS = {">=": lambda v, b: v >= b, ">": lambda v, b: v > b, "<=": lambda v, b: v <= b, "<": lambda v, b: v < b}


@dataclass(frozen=True)
class Arg:
    """What a parameter means and which values it accepts: `Annotated[int, Arg("help", ge=1)]`."""

    help: str = ""
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None

    def violation(self, value: Any) -> Optional[str]:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        bounds = [(symbol, limit) for symbol, limit in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                  if limit is not None]
        if all(BOUND_HOLDS[symbol](value, limit) for symbol, limit in bounds):
            return None
        return "is out of range: must be " + " and ".join(f"{symbol} {limit}" for symbol, limit in bounds)


class UsageError(CompactHydraException):
    """A mistake of the user's, not a bug: Hydra prints it as its message alone (no traceback), exit status 1."""


class ConfigError(UsageError):
    """Everything wrong with a configuration, one line per problem, each naming its full key."""

    def __init__(self, problems: list[str]):
        super().__init__("Invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems


@dataclass
class Param:
    name: str
    annotation: Any  # the type without Annotated's extras; Any when unknown
    default: Any  # inspect.Parameter.empty when mandatory
    arg: Arg

    @property
    def mandatory(self) -> bool:
        return self.default is inspect.Parameter.empty


@dataclass
class Schema:
    target: str
    params: dict[str, Param]
    open: bool  # the callable takes **kwargs it does not name (e.g. a transformers config)


# --- reading a signature ---------------------------------------------------------------------------------


def locate(target: str) -> Callable:
    """The callable a `_target_` names (module.attr or module.Class.attr), with a clear error."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError as error:
            if error.name and not ".".join(parts[:split]).startswith(error.name):
                raise  # the module exists but one of its own imports is missing
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            break
    raise ConfigError([f"_target_={target}: no such module or attribute"])


def schema_of(target: Callable | str, skip: tuple[str, ...] = ()) -> Schema:
    """The parameters of a callable (a class: its __init__, following **kwargs into the base classes)."""
    func = locate(target) if isinstance(target, str) else target
    name = target if isinstance(target, str) else f"{func.__module__}.{func.__qualname__}"
    params, is_open = {}, False
    callables = [c.__init__ for c in inspect.getmro(func) if "__init__" in vars(c)] if inspect.isclass(func) else [func]
    for fn in callables:
        try:
            signature = inspect.signature(fn)
            hints = typing.get_type_hints(fn, include_extras=True)
        except (TypeError, ValueError, NameError):  # builtins, C extensions, unresolvable annotations
            return Schema(name, params, open=True)
        has_var_kwargs = False
        for p in signature.parameters.values():
            if p.name == "self" or p.name in skip or p.kind is p.VAR_POSITIONAL:
                continue
            if p.kind is p.VAR_KEYWORD:
                has_var_kwargs = True
                continue
            if p.name not in params:
                annotation, arg = _unpack(hints.get(p.name, Any))
                params[p.name] = Param(p.name, annotation, p.default, arg)
        if not has_var_kwargs:
            break
    else:
        is_open = True  # **kwargs all the way up: anything may be passed through
    return Schema(name, params, is_open)


def _unpack(hint: Any) -> tuple[Any, Arg]:
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        return base, next((e for e in extras if isinstance(e, Arg)), Arg())
    return hint, Arg()


# --- checking values against a type -------------------------------------------------------------------------


def type_problem(value: Any, annotation: Any) -> Optional[str]:
    """Why `value` is not of `annotation`, or None. Types this cannot judge are accepted."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return None if value in args else f"expected one of [{', '.join(map(str, args))}]"
    if origin is Union or origin is types.UnionType:  # Optional[X] too
        if any(type_problem(value, member) is None for member in args):
            return None
        others = [member for member in args if member is not type(None)]
        return type_problem(value, others[0]) if len(others) == 1 else f"expected {_type_name(annotation)}"
    if annotation is type(None):
        return None if value is None else "expected null"
    if annotation is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected an integer, got {value!r}"
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {value!r}"
    if annotation is str:
        return None if isinstance(value, str) else f"expected a string, got {value!r}"
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple, ListConfig)):
            return f"expected a list, got {value!r}"
        if args and origin is tuple and args[-1] is not Ellipsis and len(args) != len(value):
            return f"expected a list of {len(args)} values, got {len(value)}"
        element = args[0] if args else Any
        for item in value:
            problem = type_problem(item, element)
            if problem:
                return f"in the list: {problem}"
        return None
    if origin is dict or annotation is dict:
        return None if isinstance(value, (dict, DictConfig)) else f"expected a mapping, got {value!r}"
    return None  # tensors, modules, callables...: not something a config states


def _type_name(annotation: Any) -> str:
    """int, float or null, no|fp16|bf16, tuple[int, int, int]: as a config file spells the values."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (list, tuple) and (not args or args[-1] is Ellipsis):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


# --- completing and validating a node ------------------------------------------------------------------------


def complete(node: DictConfig, schema: Schema, path: str, supplied: tuple[str, ...] = (),
             data_sizes: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """The node as a plain dict with every default filled in, and the problems found (full keys named).

    `supplied`: parameters the caller passes at build time (an optimizer's params). `data_sizes`: sizes the
    chosen data provides; a mandatory parameter of that name is wired to `${dataset:NAME}` automatically.
    Interpolations stay unresolved in the result (they are resolved when the whole config is).
    """
    problems, out = [], {}
    raw = OmegaConf.to_container(node, resolve=False)
    for key, value in raw.items():
        if key in INSTANTIATE_KEYS or key in schema.params or schema.open:
            out[key] = value
        else:
            hint = difflib.get_close_matches(key, schema.params, n=1)
            did_you_mean = f"; did you mean {path}{hint[0]}?" if hint else ""
            problems.append(f"{path}{key}: {schema.target} has no parameter {key!r}{did_you_mean} "
                            f"(it takes: {', '.join(schema.params) or 'nothing'})")
    for name, param in schema.params.items():
        if name in out or name in supplied:
            continue
        if param.mandatory:
            if name in data_sizes:
                out[name] = f"${{dataset:{name}}}"
            else:
                problems.append(f"{path}{name} is mandatory ({_describe(param, schema)}): pass {path}{name}=VALUE")
        elif _is_plain(param.default):
            out[name] = list(param.default) if isinstance(param.default, tuple) else param.default
    return out, problems


def check_values(cfg: DictConfig, group: str, schema: Schema) -> list[str]:
    """Type, range and MISSING checks of one completed group node, resolving interpolations except data sizes."""
    node, problems = cfg[group], []
    for key in node.keys():
        full_key = f"{group}.{key}"
        if key in INSTANTIATE_KEYS:
            continue
        if OmegaConf.is_missing(node, key):
            param = schema.params.get(key)
            help_text = f" ({_describe(param, schema)})" if param else ""
            problems.append(f"{full_key} is mandatory{help_text}: pass {full_key}=VALUE")
            continue
        try:
            value = node[key]
        except InterpolationKeyError as error:
            problems.append(_missing_interpolation(full_key, OmegaConf.to_container(node)[key], cfg, error))
            continue
        except InterpolationResolutionError as error:
            if DataSizeUnknown.__name__ in str(error):  # OmegaConf names the resolver's exception, not chains it
                continue  # resolved once the data is built
            problems.append(f"{full_key}: {error}")
            continue
        param = schema.params.get(key)
        if param is None:
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            try:
                value = OmegaConf.to_container(value, resolve=True)
            except InterpolationResolutionError:
                continue
        problem = type_problem(value, param.annotation) or param.arg.violation(value)
        if problem:
            shown = OmegaConf.to_yaml(value).strip() if isinstance(value, (list, dict)) else value
            problems.append(f"{full_key}={shown} {problem}" + (f" ({param.arg.help})" if param.arg.help else ""))
    return problems


def _missing_interpolation(full_key: str, raw: Any, cfg: DictConfig, error: Exception) -> str:
    referenced = re.search(r"\$\{([\w.]+)\}", str(raw))
    if referenced and "." in referenced.group(1):
        group, _, key = referenced.group(1).partition(".")
        target = OmegaConf.select(cfg, f"{group}._target_", default="?")
        return (f"{full_key}={raw}, but {group}={chosen_option(cfg, group)} ({target}) has no {key!r}: "
                f"set {full_key}=VALUE")
    return f"{full_key}={raw}: {error}"


def chosen_option(cfg: DictConfig, group: str) -> str:
    """The option name of a group (model=gpt), for messages; Hydra records it in the config it composes."""
    return str(OmegaConf.select(cfg, f"hydra.runtime.choices.{group}", default=None) or "(your choice)")


def _describe(param: Param, schema: Schema) -> str:
    what = param.arg.help or f"a parameter of {schema.target}"
    return f"{what}; {_type_name(param.annotation)}" if param.annotation is not Any else what


def _is_plain(value: Any) -> bool:
    """Whether a default can be written into config.yaml (a number, string, bool, None or a list of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return False


# --- sizes that come from the data -----------------------------------------------------------------------


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


def describe(target: str | Callable) -> str:
    """Every parameter of a component: name, type, default and help (for `python -m src.schema TARGET`)."""
    schema = schema_of(target)
    rows = [(n, _type_name(p.annotation), "(mandatory)" if p.mandatory else repr(p.default), p.arg.help)
            for n, p in schema.params.items()]
    widths = [max(len(r[i]) for r in rows) if rows else 0 for i in range(3)]
    return "\n".join(f"{n:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {h}" for n, t, d, h in rows)


def flatten(node: dict, prefix: str = "") -> dict:
    """full.key -> value of every leaf of a plain nested dict (lists count as one value)."""
    out = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def markdown_reference(target: str | Callable, prefix: str) -> str:
    """The parameters as a Markdown table (`python -m src.schema --markdown TARGET PREFIX`): the README's
    reference of `trainer.*` is this output, and a test keeps it so."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, p in schema_of(target).params.items():
        default = ("(mandatory)" if p.mandatory else f"[{', '.join(map(str, p.default))}]"
                   if isinstance(p.default, (list, tuple)) else OmegaConf.to_yaml({"v": p.default}).strip()[3:])
        cells = (f"`{prefix}{name}`", _type_name(p.annotation), f"`{default}`", p.arg.help)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    from src import schema  # the components import src.schema, whose Arg is not this __main__'s

    if sys.argv[1] == "--markdown":
        print(schema.markdown_reference(sys.argv[2], sys.argv[3]))
    else:
        print(schema.describe(sys.argv[1]))

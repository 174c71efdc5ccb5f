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

import difflib
import importlib
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

from src.errors import ConfigError
from src.schema.data_sizes import DataSizeUnknown

# Keys Hydra's instantiate reads; they are not parameters of the target.
INSTANTIATE_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


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
        return type_problem(value, others[0]) if len(others) == 1 else f"expected {type_name(annotation)}"
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


def type_name(annotation: Any) -> str:
    """int, float or null, no|fp16|bf16, tuple[int, int, int]: as a config file spells the values."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (list, tuple) and (not args or args[-1] is Ellipsis):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


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
            shown = json.dumps(value, default=str) if isinstance(value, (list, dict)) else value  # as typed
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
    return f"{what}; {type_name(param.annotation)}" if param.annotation is not Any else what


def _is_plain(value: Any) -> bool:
    """Whether a default can be written into config.yaml (a number, string, bool, None or a list of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return False

"""A component's parameters as text: the `python -m src.schema` listing and the README's Markdown table."""

from typing import Callable

from omegaconf import OmegaConf

from src.schema.signature import schema_of, type_name


def describe(target: str | Callable) -> str:
    """Every parameter of a component: name, type, default and help (for `python -m src.schema TARGET`)."""
    schema = schema_of(target)
    rows = [(n, type_name(p.annotation), "(mandatory)" if p.mandatory else repr(p.default), p.arg.help)
            for n, p in schema.params.items()]
    widths = [max(len(r[i]) for r in rows) if rows else 0 for i in range(3)]
    return "\n".join(f"{n:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {h}" for n, t, d, h in rows)


def markdown_reference(target: str | Callable, prefix: str) -> str:
    """The parameters as a Markdown table (`python -m src.schema --markdown TARGET PREFIX`): the README's
    reference of `trainer.*` is this output, and a test keeps it so."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, p in schema_of(target).params.items():
        default = ("(mandatory)" if p.mandatory else f"[{', '.join(map(_cell, p.default))}]"
                   if isinstance(p.default, (list, tuple)) else OmegaConf.to_yaml({"v": p.default}).strip()[3:])
        cells = (f"`{prefix}{name}`", type_name(p.annotation), f"`{default}`", p.arg.help)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def _cell(value) -> str:
    """A list item as one table cell shows it: a string with a line break or a comma quoted, as YAML would."""
    text = str(value)
    return repr(text) if any(ch in text for ch in "\n,") else text

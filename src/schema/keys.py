"""Full dotted keys of nested configs."""



def flatten(node: dict, prefix: str = "") -> dict:
    """full.key -> value of every leaf of a plain nested dict (lists count as one value)."""
    out = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out

"""A local tokenizer for text data: a `tokenizers` JSON file, or a `from_pretrained` folder that holds one.

With `model.pretrained=PATH` the text options default to that folder's tokenizer (config/data/text.yaml,
config/data/jsonl.yaml), so a pretrained model reads the ids it was trained on. `tokenizers` comes with
transformers (requirements-extras.txt); nothing is downloaded.
"""

from pathlib import Path
from typing import Any

from src.schema.errors import UsageError

FILE = "tokenizer.json"  # the name save_pretrained gives a fast tokenizer's file


def tokenizer_file(path: str, key: str = "data.tokenizer") -> Path:
    """The tokenizers JSON file `path` names (itself, or FILE inside a folder), or an error naming `key`."""
    file = Path(path).expanduser()
    if file.is_dir():
        if not (file / FILE).is_file():
            raise UsageError(f"{key}={path}: the folder has no {FILE} (a fast tokenizer saved by save_pretrained); "
                             f"give a tokenizers JSON file, or byte / char where {key} allows them")
        file = file / FILE
    if not file.is_file():
        raise FileNotFoundError(f"{key}={path!r}: no such file or folder (relative paths are relative to "
                                f"{Path.cwd()})")
    return file


def load_tokenizer(path: str, key: str = "data.tokenizer") -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise UsageError(f"{key}={path} needs tokenizers: pip install -r requirements-extras.txt") from error
    file = tokenizer_file(path, key)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{key}={path}: {file} is not a tokenizers JSON file ({error})") from None

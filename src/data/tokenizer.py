"""A tokenizer for text data (a `tokenizers` JSON file, a `from_pretrained` folder that holds one, or a Hugging
Face hub id whose snapshot holds one: src/models/hub.py), and
the Codec each text option exposes: how its text becomes ids and back, for sampling and for the export.

With `model.pretrained` the text options default to that model's tokenizer (config/data/text.yaml,
config/data/jsonl.yaml), so a pretrained model reads the ids it was trained on. `tokenizers` comes with
transformers (requirements-extras.txt).
"""

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from src.errors import UsageError
from src.models.hub import TOKENIZER_FILES, local_path

log = logging.getLogger(__name__)
FILE = "tokenizer.json"  # the name save_pretrained gives a fast tokenizer's file
BUILT_IN_TOKENIZERS = ("byte", "char")  # data.tokenizer values that name no file
REVISION = ("with a hub id as data.tokenizer: its branch, tag or commit (null: the newest, whose commit the run's "
            "config then records, so that a resume or an evaluation reads the same files)")


def tokenizer_file(path: str, key: str = "data.tokenizer", instead: str = "", revision: Optional[str] = None) -> Path:
    """The tokenizers JSON file `path` names (itself, or FILE inside a folder), or an error naming `key`;
    `instead`: what else the key takes, as the overrides to type (`data.tokenizer=byte`); `revision`: a hub id's
    commit (or branch, tag) to read."""
    file = local_path(path, key, TOKENIZER_FILES, revision=revision)  # a hub id: its snapshot in the HF cache
    if file.is_dir():
        if not (file / FILE).is_file():
            raise UsageError(f"{key}={path}: the folder has no {FILE} (a fast tokenizer saved by save_pretrained); "
                             f"give {key}=PATH of a tokenizers JSON file or a folder with one"
                             + (f", or {instead}" if instead else ""))
        file = file / FILE
    if not file.is_file():
        raise FileNotFoundError(f"{key}={path!r}: no such file or folder (relative paths are relative to "
                                f"{Path.cwd()})")
    return file


def load_tokenizer(path: str, key: str = "data.tokenizer", instead: str = "", revision: Optional[str] = None) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise UsageError(f"{key}={path} needs tokenizers: pip install -r requirements-extras.txt") from error
    file = tokenizer_file(path, key, instead, revision)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{key}={path}: {file} is not a tokenizers JSON file ({error})") from None
    if tokenizer.truncation or tokenizer.padding:  # saved with the file, they would cut or pad every document
        log.info("%s=%s: its saved truncation and padding are ignored (the data options cut documents to "
                 "data.block_size and pad batches themselves)", key, path)
        tokenizer.no_truncation()
        tokenizer.no_padding()
    return tokenizer


class Codec:
    """Text <-> token ids, as the data tokenized it: what sampling needs, and what an export keeps beside the
    weights so that `python sample.py outputs/RUN/model` reads and writes text without the training data."""

    SAVED = "vocabulary.json"

    def __init__(self, kind: str, chars: str = "", tokenizer: Any = None, end_of_text: Optional[int] = None,
                 chat: Optional["ChatTemplate"] = None):
        self.kind, self.chars, self.tokenizer = kind, chars, tokenizer
        self.end_of_text = end_of_text  # the id that ends a completion (prompted data), where the tokenizer has one
        self.chat = chat  # renders messages as text, where the tokenizer has a chat template
        self._index = {ch: i for i, ch in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        if self.kind == "byte":
            return 256
        return len(self.chars) if self.kind == "char" else self.tokenizer.get_vocab_size()

    def identity(self) -> str:
        """What the ids mean, comparable between runs: the bytes, the characters, or a digest of the tokenizer."""
        if self.kind == "tokenizer":
            return "tokenizer " + hashlib.blake2b(self.tokenizer.to_str().encode(), digest_size=8).hexdigest()
        return "bytes" if self.kind == "byte" else self.chars

    def describe(self) -> str:
        """identity() for a message: a tokenizer with its digest, not the characters one by one."""
        if self.kind == "char":
            return f"characters ({len(self.chars)}: {self.chars[:20]!r}...)"
        return self.identity() if self.kind == "tokenizer" else "bytes"

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """`special_tokens`: what the tokenizer adds around a whole text (a BOS token in front, for Llama's,
        Mistral's or Gemma's); false for a piece of a text, or a text a chat template rendered with its own."""
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        if self.kind == "char":
            unknown = sorted(set(text) - set(self._index))
            if unknown:
                raise UsageError(f"{text!r}: the characters {''.join(unknown)!r} are not in the data's vocabulary "
                                 f"(character level: only the training file's {len(self.chars)} characters)")
            return [self._index[ch] for ch in text]
        return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of whole texts, many at once: a tokenizer's batch path (2.3x its one text at a time on one
        thread here, and on as many threads as RAYON_NUM_THREADS allows)."""
        if self.kind == "tokenizer":
            return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=True)]
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        if self.kind == "byte":
            return bytes(ids).decode("utf-8", errors="replace")
        if self.kind == "char":
            return "".join(self.chars[i] for i in ids)
        return self.tokenizer.decode(ids)

    def save(self, directory: Path) -> None:
        (directory / self.SAVED).write_text(json.dumps({"kind": self.kind, "chars": self.chars}))
        if self.kind == "tokenizer" and not (directory / FILE).exists():  # a pretrained folder's is copied
            self.tokenizer.save(str(directory / FILE))

    @classmethod
    def load(cls, directory: Path) -> "Codec":
        saved = directory / cls.SAVED
        if saved.is_file():
            record = json.loads(saved.read_text())
            if record["kind"] != "tokenizer":
                return cls(record["kind"], record["chars"])
        if (directory / FILE).is_file():  # ours, or any from_pretrained folder with a fast tokenizer
            return cls("tokenizer", tokenizer=load_tokenizer(str(directory), "the model folder"))
        raise FileNotFoundError(f"{directory}: neither {cls.SAVED} nor {FILE}, so its text cannot be encoded: "
                                "an export of a run on text data has one")


def codec_for(name: Optional[str], texts: Optional[list[str]] = None, key: str = "data.tokenizer",
              revision: Optional[str] = None) -> Codec:
    """data.tokenizer as a Codec: byte (also null), char (the characters of `texts`, where the option has them
    all up front), or a tokenizers file / from_pretrained folder. Padding is id 0 in every vocabulary."""
    if name is None or name == "byte":
        return Codec("byte")
    if name == "char":
        if texts is None:
            raise UsageError(f"{key}=char: this data option reads its documents lazily; give {key}=byte or a "
                             "tokenizer")
        return Codec("char", "".join(sorted(set("".join(texts)))))
    file = tokenizer_file(name, key, f"{key}=byte or {key}=char" if texts is not None else f"{key}=byte", revision)
    tokenizer = load_tokenizer(str(file), key)
    return Codec("tokenizer", tokenizer=tokenizer, end_of_text=end_of_text_id(file, tokenizer),
                 chat=ChatTemplate.of(file.parent))


class ChatTemplate:
    """A tokenizer folder's chat template (tokenizer_config.json's chat_template, or chat_template.jinja), applied by
    transformers' own apply_chat_template: messages [{role, content}, ...] as the text the model was tuned on."""

    def __init__(self, folder: Path, source: str):
        self.folder, self.source, self._tokenizer = folder, source, None

    @classmethod
    def of(cls, folder: Path) -> Optional["ChatTemplate"]:
        config = folder / "tokenizer_config.json"
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(folder, json.dumps(template)) if template else None

    def __call__(self, messages: list, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return self._tokenizer

    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's text itself ({% generation %}), as transformers'
        return_assistant_tokens_mask needs."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", json.loads(self.source)) is not None

    def assistant_tokens(self, messages: list) -> tuple[list[int], list[bool]]:
        """A whole conversation's token ids, and which of them are the assistant's: transformers' own mask where
        the template marks them; otherwise every assistant turn is what the template adds when that turn follows
        the conversation before it (rendered with the cue for the assistant's turn), each token whose characters
        lie inside such a span. A template that renders a prefix of the conversation differently alone and
        continued is refused: its assistant turns cannot be told apart."""
        messages = [dict(m) for m in messages]
        if self.marks_generation():
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                          return_assistant_tokens_mask=True)
            return list(rendered["input_ids"]), [bool(m) for m in rendered["assistant_masks"]]
        whole, spans = self(messages), []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, after = self(messages[:i], add_generation_prompt=True), self(messages[: i + 1])
            if not (after.startswith(before) and whole.startswith(after)):
                raise UsageError(
                    "data: this chat template renders a conversation's beginning differently alone and continued "
                    f"(at message {i + 1}, {before[-30:]!r} then {after[len(before) - 10:len(before) + 20]!r}), so "
                    "the assistant's turns cannot be told from the rest; mark them in the template with "
                    "{% generation %} ... {% endgeneration %}, as transformers' return_assistant_tokens_mask reads")
            spans.append((len(before), len(after)))
        encoded = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        inside = [any(start <= a and b <= end for start, end in spans) and b > a for a, b in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), inside


def end_of_text_id(file: Path, tokenizer: Any) -> Optional[int]:
    """The id of the end-of-text token that the tokenizer's folder names (tokenizer_config.json's eos_token, as
    save_pretrained writes it), or None."""
    config = file.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def check_same_ids(key: str, folder: Path, codec: Optional[Codec], reads: str, remedy: str,
                   fingerprint: Optional[dict] = None) -> bool:
    """Weights in `folder` read ids as the folder says they were made; this run's data must mean the same tokens by
    them, else each id would mean another token, silently wherever the ids fit the embedding. What the folder says:
    its tokenizer or vocabulary.json (an export, a transformers folder), else its data.json (a checkpoint: `ids made
    by`, or for older checkpoints of text data their `vocabulary`, compared with this run's `fingerprint`'s).
    Refused naming `key`, what `reads` them and the `remedy`; False where there is nothing to compare (data that is
    not text, a folder of weights alone)."""
    from src.checkpointing.layout import DATA_FILE
    from src.data.base import IDS_MADE_BY, described_ids, ids_made_by

    if codec is None:
        return False
    ours = ids_made_by(codec)
    try:
        theirs = ids_made_by(Codec.load(folder))
    except FileNotFoundError:
        saved = json.loads((folder / DATA_FILE).read_text()) if (folder / DATA_FILE).is_file() else {}
        theirs = saved.get(IDS_MADE_BY)
        if theirs is None and "vocabulary" in saved and fingerprint and "vocabulary" in fingerprint:
            theirs, ours = saved["vocabulary"], fingerprint["vocabulary"]  # a checkpoint from before `ids made by`
    if theirs is None:
        return False
    if theirs != ours:
        raise UsageError(f"{key}: {reads} token ids as {described_ids(theirs)} made them, but this run's data was "
                         f"tokenized by {described_ids(ours)}{_first_difference(theirs, ours)}: each id would mean "
                         f"another token. {remedy}")
    return True


def _first_difference(theirs: str, ours: str, context: int = 10, width: int = 30) -> str:
    """Where two character sets part, for a message (tokenizers and bytes are told apart by their names)."""
    if any(text.startswith(("tokenizer ", "characters ")) or text == "bytes" for text in (theirs, ours)):
        return ""
    first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    start = max(0, first - context)
    there, here = (("..." if start else "") + text[start:start + width] + ("..." if len(text) > start + width else "")
                   for text in (theirs, ours))
    return f" (they part at {there!r} there, {here!r} here)"

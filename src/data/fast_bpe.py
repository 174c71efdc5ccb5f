"""tiktoken as a faster twin of a byte-level BPE tokenizer (GPT-2's kind, Llama-3's kind) for the preparation of
plain text: the same ids, about 3x `tokenizers`' batch path on one core (scripts/BENCHMARKS.md, "Data").

Both run byte-level BPE over the same pre-tokenizing regex, but they merge differently: `tokenizers` applies its
merge list in order, tiktoken merges any pair whose concatenation is a token, lowest id first. They agree when
the ids follow the merge order and no token is reachable by a pair that is not a listed merge, which a vocabulary
does not promise, and their regex engines (Oniguruma, fancy-regex) could part on a rare character class. So the
twin is built only where the tokenizer's JSON has nothing tiktoken lacks (a normalizer, byte fallback, stripped
added tokens, truncation), and the preparation checks it against `tokenizers` as it goes (CheckedTwin): one
document in `check_every`; at the first difference the task starts again with `tokenizers` alone.
"""

import json
import os
from typing import Any, Optional

# The ByteLevel pre-tokenizer's own regex (use_regex=true), as GPT-2 and tiktoken's "gpt2" write it.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_of_character() -> dict[str, int]:
    """ByteLevel's alphabet: each of the 256 bytes as the printable character its vocabulary spells it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


class TiktokenTwin:
    """encode_batch as Codec.encode_batch gives it (the post-processor's special tokens around each text)."""

    def __init__(self, encoding: Any, prefix: list[int], suffix: list[int]):
        self.encoding, self.prefix, self.suffix = encoding, prefix, suffix
        # A preparation worker's share of the CPUs (src/data/prepare.py sizes tokenizers' pool by the same variable).
        self.threads = int(os.environ.get("RAYON_NUM_THREADS", "1"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.threads > 1:
            ids = self.encoding.encode_batch(texts, num_threads=self.threads, allowed_special="all",
                                             disallowed_special=())
        else:  # its batch call hands each text to a thread pool: 0.2 s per 1,000 texts of overhead with one thread
            ids = [self.encoding.encode(text, allowed_special="all", disallowed_special=()) for text in texts]
        return [[*self.prefix, *one, *self.suffix] for one in ids] if self.prefix or self.suffix else ids


def _pattern(pre_tokenizer: Optional[dict]) -> tuple[Optional[str], str]:
    """The regex that splits text before BPE, where the pre-tokenizer is one tiktoken can follow."""
    if pre_tokenizer is None:
        return None, "no ByteLevel pre-tokenizer"
    if pre_tokenizer["type"] == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None, "a ByteLevel pre-tokenizer that adds a space or splits by no regex"
        return GPT2_PATTERN, ""
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer["type"] == "Sequence" else []
    if (len(steps) == 2 and steps[0]["type"] == "Split" and "Regex" in steps[0]["pattern"]
            and steps[0]["behavior"] == "Isolated" and not steps[0]["invert"] and steps[1]["type"] == "ByteLevel"
            and not steps[1].get("add_prefix_space") and not steps[1].get("use_regex", True)):
        return steps[0]["pattern"]["Regex"], ""  # Llama-3's, Qwen's layout: the regex, then bytes
    return None, f"a {pre_tokenizer['type']} pre-tokenizer"


def tiktoken_twin(tokenizer: Any) -> tuple[Optional[TiktokenTwin], str]:
    """The twin of a `tokenizers.Tokenizer`, or None and why not (tiktoken missing, not byte-level BPE, ...)."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (pip install -r requirements-extras.txt)"
    spec = json.loads(tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE" or model.get("byte_fallback") or model.get("dropout") or \
            model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "not a plain byte-level BPE model"
    for key in ("normalizer", "truncation", "padding"):
        if spec.get(key):
            return None, f"the tokenizer has a {key}"
    pattern, why = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None, why
    added = spec.get("added_tokens", [])
    if any(token["lstrip"] or token["rstrip"] or token["single_word"] for token in added):
        return None, "an added token strips spaces or matches single words only"
    contents = [token["content"] for token in added]
    if any(a != b and b.startswith(a) for a in contents for b in contents):
        return None, "an added token begins another (their order of matching would matter)"
    byte_of = _byte_of_character()
    special = {token["content"]: token["id"] for token in added}
    try:
        ranks = {bytes(byte_of[ch] for ch in piece): rank for piece, rank in model["vocab"].items()
                 if rank not in special.values()}
    except KeyError:
        return None, "its vocabulary is not spelt in ByteLevel's alphabet"
    if len(ranks) != len(set(ranks.values())) or any(bytes([b]) not in ranks for b in range(256)):
        return None, "its vocabulary lacks a byte or spells one token twice"
    encoding = tiktoken.Encoding("twin", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    # Where the post-processor puts special tokens (a BOS): around the text's own ids, found on a sample text.
    bare, whole = tokenizer.encode("x", add_special_tokens=False).ids, tokenizer.encode("x").ids
    at = next((i for i in range(len(whole) - len(bare) + 1) if whole[i : i + len(bare)] == bare), None)
    if at is None:
        return None, "its post-processor changes the text's own ids"
    return TiktokenTwin(encoding, whole[:at], whole[at + len(bare):]), ""


class TwinDiffers(Exception):
    """The twin gave other ids than `tokenizers` for a document: the preparation's task starts again without it."""


class CheckedTwin:
    """A Codec's encode_batch by the twin, every `check_every`-th document compared with the codec's own ids."""

    def __init__(self, twin: TiktokenTwin, codec: Any, check_every: int):
        self.twin, self.codec, self.check_every = twin, codec, check_every
        self.seen = self.checked = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        ids = self.twin.encode_batch(texts)
        first = -self.seen % self.check_every  # the first text of this batch whose number is a multiple
        sample = list(range(first, len(texts), self.check_every))
        for i, expected in zip(sample, self.codec.encode_batch([texts[i] for i in sample])):
            if ids[i] != expected:
                raise TwinDiffers(f"document {self.seen + i} of the task: tiktoken gave {len(ids[i])} ids, "
                                  f"tokenizers {len(expected)}, first difference at id "
                                  f"{next((n for n, (a, b) in enumerate(zip(ids[i], expected)) if a != b), '(end)')}")
        self.seen += len(texts)
        self.checked += len(sample)
        return ids

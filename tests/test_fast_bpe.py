"""The preparation's tiktoken twin of a byte-level BPE tokenizer (src/data/fast_bpe.py): the same ids as
`tokenizers` where it is built, no twin where the tokenizer has what tiktoken lacks, and a twin that differs is
caught and the task tokenized again by `tokenizers`, so the shards never depend on which one ran."""

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from src.data.fast_bpe import CheckedTwin, TwinDiffers, tiktoken_twin
from src.data.prepare import Source, prepare
from src.data.tokenizer import Codec

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = (ROOT / "data" / "tinyshakespeare.txt").read_text().splitlines()
# Llama-3's pre-tokenizing regex (tiktoken's cl100k_base): case-blind contractions, digits in threes.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HARD_TEXTS = [  # what the two could part on: special tokens inside text, whitespace runs, scripts, digits, case
    "Hello<|endoftext|>world<|endoftext|>", "  two leading spaces", "tabs\tand\nnewlines\n\n\n  end  ",
    "DON'T you'LL we've THEY'RE", "naïve café — 東京の空 🙂🙂 Ωμέγα", "1234567 3.14159 2026-11-27", "", "   ",
    "x" * 300, "ab" * 150, "<|begin_of_text|>already there", "\u00a0non-breaking\u2009thin\u3000ideographic",
    "emoji 👩‍👩‍👧 flags 🇫🇷 and combining e\u0301",
]


def byte_level_bpe(layout: str, vocab_size: int = 1500) -> Tokenizer:
    """A byte-level BPE trained on tiny Shakespeare, laid out as GPT-2's tokenizer.json or Llama-3's."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=layout == "llama3"))
    if layout == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = ["<|endoftext|>"]
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(SHAKESPEARE, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if layout == "llama3":  # a BOS before every text, as Llama-3's post-processor puts it
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    return tokenizer


@pytest.mark.parametrize("layout", ["gpt2", "llama3"])
def test_the_twin_gives_the_ids_tokenizers_gives_for_gpt2s_and_llama3s_layouts(layout):
    tokenizer = byte_level_bpe(layout)
    twin, why = tiktoken_twin(tokenizer)
    assert twin is not None, why
    texts = [*HARD_TEXTS, *SHAKESPEARE[:3000]]
    expected = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    got = twin.encode_batch(texts)
    differing = [(text, a, b) for text, a, b in zip(texts, got, expected) if a != b]
    assert not differing, differing[:3]
    if layout == "llama3":
        assert all(ids[0] == tokenizer.token_to_id("<|begin_of_text|>") for ids in got)


@pytest.mark.parametrize("change, reason", [
    (lambda t: setattr(t, "normalizer", normalizers.NFC()), "normalizer"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)), "adds a space"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()), "Whitespace pre-tokenizer"),
    (lambda t: t.enable_truncation(16), "truncation"),
])
def test_a_tokenizer_with_what_tiktoken_lacks_gets_no_twin_and_the_reason(change, reason):
    tokenizer = byte_level_bpe("gpt2", vocab_size=400)
    change(tokenizer)
    twin, why = tiktoken_twin(tokenizer)
    assert twin is None and reason in why, why


def merges_tiktoken_reads_otherwise() -> Tokenizer:
    """A valid byte-level BPE on which the two part: "abc" is a token, made by merging "a" with "bc", but in "abc"
    tokenizers merges "a"+"b" first and then has no merge for "ab"+"c", while tiktoken takes "abc" whole."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for piece in ("ab", "bc", "abc"):
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [("a", "b"), ("b", "c"), ("a", "bc")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_a_checked_twin_names_the_first_document_whose_ids_differ():
    tokenizer = merges_tiktoken_reads_otherwise()
    twin, why = tiktoken_twin(tokenizer)
    assert twin is not None, why
    checked = CheckedTwin(twin, Codec("tokenizer", tokenizer=tokenizer), check_every=2)
    assert checked.encode_batch(["bc", "a b", "c"]) == [[tokenizer.token_to_id("bc")], *[
        e.ids for e in tokenizer.encode_batch(["a b", "c"])]]  # documents 0 and 2 checked: the same
    assert checked.checked == 2
    with pytest.raises(TwinDiffers, match="document 4 "):
        checked.encode_batch(["abc", "abc", "x"])  # document 3 is not checked, document 4 is


def prepared(tmp_path: Path, name: str, tokenizer_file: Path, corpus: Path, fast_bpe: bool) -> dict:
    return prepare(Source(str(corpus), str(tokenizer_file)), tmp_path / name, workers=1, tasks=2,
                   val_fraction=0.2, fast_bpe=fast_bpe)


@pytest.mark.parametrize("which", ["twin", "differing twin"])
def test_the_shards_are_what_tokenizers_alone_writes_whether_the_twin_holds_or_is_caught(tmp_path, which):
    tokenizer = byte_level_bpe("gpt2") if which == "twin" else merges_tiktoken_reads_otherwise()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "corpus.jsonl"
    lines = SHAKESPEARE[:400] if which == "twin" else [f"abc {line}" for line in SHAKESPEARE[:400]]
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    fast = prepared(tmp_path, "fast", tmp_path / "tokenizer.json", corpus, fast_bpe=True)
    alone = prepared(tmp_path, "alone", tmp_path / "tokenizer.json", corpus, fast_bpe=False)
    for split in ("train", "validation"):
        for task, reference in zip(fast["splits"][split], alone["splits"][split]):
            assert task["digest"] == reference["digest"] and task["tokens"] == reference["tokens"] > 0
            assert reference["encoder"] == "tokenizers" and reference["why"] == "--no-fast-bpe"
            if which == "twin":
                assert task["encoder"] == "tiktoken" and task["documents checked against tokenizers"] > 0, task
            else:
                assert task["encoder"] == "tokenizers" and task["why"].startswith("tiktoken differed"), task

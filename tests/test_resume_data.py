"""A checkpoint records the data it was trained on; a resume on other data is refused unless asked for."""

import json
import logging

import pytest

from src.checkpointing.layout import DATA_FILE
from src.checkpointing.resume import check_same_data
from src.data.text import TextData
from src.errors import UsageError
from tests.conftest import QUIET, TINY_GPT, named, refused, run

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400))


def text_data(path, text: str) -> TextData:
    path.write_text(text)
    return TextData(path=str(path), block_size=16)


def test_the_fingerprint_is_stable_and_changes_with_the_content_the_samples_or_the_vocabulary(tmp_path):
    file = tmp_path / "t.txt"
    same = text_data(file, TEXT).fingerprint()
    assert text_data(file, TEXT).fingerprint() == same
    edited = text_data(file, TEXT.replace("lazy", "hazy")).fingerprint()  # same length, other text
    assert edited["train sampled content"] != same["train sampled content"]
    assert text_data(file, TEXT + TEXT).fingerprint()["train samples"] > same["train samples"]
    assert text_data(file, TEXT.upper()).fingerprint()["vocabulary"] != same["vocabulary"]


def bytes_read_by_this_process() -> int:
    return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])


def test_the_fingerprint_names_each_source_file_and_catches_an_edit_between_the_sampled_samples(tmp_path):
    file = tmp_path / "t.txt"
    same = text_data(file, TEXT).fingerprint()
    assert same["file t.txt"].startswith(f"{len(TEXT.encode())} bytes, ")
    # One character of one line: none of the 32 samples the fingerprint hashes holds it, the file's hash sees it.
    edited = text_data(file, TEXT.replace("line 123: the quick", "line 123: the quack")).fingerprint()
    assert edited["train sampled content"] == same["train sampled content"]
    assert edited["file t.txt"] != same["file t.txt"]


def test_a_large_file_is_fingerprinted_from_a_megabyte_of_it_and_still_sees_a_change_in_a_read_chunk(tmp_path):
    from src.data.base import file_digest

    big = tmp_path / "big.bin"
    content = bytearray(64 << 20)
    big.write_bytes(content)
    read_before = bytes_read_by_this_process()
    digest = file_digest(big)
    assert bytes_read_by_this_process() - read_before < 2 << 20  # of 64 MiB
    content[0] = 1  # the first chunk is always read
    big.write_bytes(content)
    assert file_digest(big) != digest


def test_a_resume_on_other_data_is_refused_naming_what_changed_unless_accepted(tmp_path, caplog):
    checkpoint = tmp_path / "step_00000010"
    checkpoint.mkdir()
    saved = text_data(tmp_path / "t.txt", TEXT).fingerprint()
    (checkpoint / DATA_FILE).write_text(json.dumps(saved))
    assert check_same_data(checkpoint, saved, accept_changed=False) is False
    other = text_data(tmp_path / "t.txt", TEXT.replace("lazy", "hazy")).fingerprint()
    with pytest.raises(UsageError) as error:
        check_same_data(checkpoint, other, accept_changed=False)
    named(str(error.value), "file t.txt", "train sampled content", "trainer.resume_with_changed_data=true")
    unchanged = [key for key in saved if saved[key] == other.get(key)]
    assert unchanged and not any(f"{key}:" in str(error.value) for key in unchanged)  # only what changed is named
    with caplog.at_level(logging.WARNING):
        assert check_same_data(checkpoint, other, accept_changed=True) is True
    assert "continuing from an epoch boundary" in caplog.text


def test_a_checkpoint_from_before_files_were_fingerprinted_resumes_on_its_unchanged_data(tmp_path):
    checkpoint = tmp_path / "step_00000010"
    checkpoint.mkdir()
    fingerprint = text_data(tmp_path / "t.txt", TEXT).fingerprint()
    (checkpoint / DATA_FILE).write_text(json.dumps({k: v for k, v in fingerprint.items() if not k.startswith("file ")}))
    assert check_same_data(checkpoint, fingerprint, accept_changed=False) is False


def test_a_run_resumed_after_its_training_file_was_replaced_stops_before_training_and_changes_nothing(tmp_path):
    data, run_dir = tmp_path / "data.txt", tmp_path / "run"
    data.write_text(TEXT)
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.checkpoint_every=5", f"data.path={data}",
            f"hydra.run.dir={run_dir}"]
    run(args + ["trainer.max_steps=5"])
    data.write_text(TEXT.replace("fox", "cat"))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    refused(run(args + ["trainer.max_steps=10", "resume=auto"], check=False),
            "data.txt", "trainer.resume_with_changed_data=true")  # the file that changed, the key that accepts it
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    accepted = run(args + ["trainer.max_steps=10", "resume=auto", "trainer.resume_with_changed_data=true"])
    assert "continuing from an epoch boundary" in accepted.stdout and "(epoch 1, 0 samples in)" in accepted.stdout

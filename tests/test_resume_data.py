"""A checkpoint records the data it was trained on; a resume on other data is refused unless asked for."""

import json
import logging

import pytest

from src.checkpointing.layout import DATA_FILE
from src.checkpointing.resume import check_same_data
from src.data.base import IDS_MADE_BY
from src.data.text import TextData
from src.errors import UsageError
from tests.conftest import QUIET, TINY_GPT, named, refused, run, scalars

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
    data.write_text(TEXT.replace("fox", "xof"))  # the same characters: the same ids
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    refused(run(args + ["trainer.max_steps=10", "resume=auto"], check=False),
            "data.txt", "trainer.resume_with_changed_data=true")  # the file that changed, the key that accepts it
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    accepted = run(args + ["trainer.max_steps=10", "resume=auto", "trainer.resume_with_changed_data=true"])
    assert "continuing from an epoch boundary" in accepted.stdout and "(epoch 1, 0 samples in)" in accepted.stdout


def test_other_data_whose_ids_mean_other_tokens_is_refused_even_where_other_data_is_accepted(tmp_path):
    checkpoint = tmp_path / "step_00000010"
    checkpoint.mkdir()
    saved = text_data(tmp_path / "t.txt", TEXT).fingerprint()
    (checkpoint / DATA_FILE).write_text(json.dumps(saved))
    other_characters = text_data(tmp_path / "t.txt", TEXT.upper()).fingerprint()
    with pytest.raises(UsageError) as error:
        check_same_data(checkpoint, other_characters, accept_changed=True)
    named(str(error.value), f"the {len(set(TEXT.upper()))} characters", "would mean another token")
    same_characters = text_data(tmp_path / "t.txt", TEXT[len(TEXT) // 2:] + TEXT[:len(TEXT) // 2]).fingerprint()
    assert check_same_data(checkpoint, same_characters, accept_changed=True) is True
    # A checkpoint from before the codec was fingerprinted: as before, the vocabulary is only named among the changes.
    (checkpoint / DATA_FILE).write_text(json.dumps({k: v for k, v in saved.items() if k != IDS_MADE_BY}))
    assert check_same_data(checkpoint, other_characters, accept_changed=True) is True


@pytest.fixture(scope="module")
def wsd_on_bytes(tmp_path_factory):
    """A WSD run at byte level that evaluates (a best checkpoint), with checkpoints at steps 4 and 8."""
    run_dir = tmp_path_factory.mktemp("anneal") / "first"
    run([*TINY_GPT, *QUIET, "data.level=byte", "scheduler=wsd", "scheduler.warmup_steps=2", "trainer.max_steps=8",
         "trainer.checkpoint_every=4", "trainer.eval_every=4", f"hydra.run.dir={run_dir}"])
    return run_dir


def test_a_resume_may_change_the_data_keys_when_asked_and_goes_on_from_an_epoch_boundary_of_the_new_data(
        wsd_on_bytes, tmp_path):
    """An annealing branch: the checkpoint's weights, optimizer and schedule go on, on other text."""
    other = tmp_path / "other.txt"
    other.write_text(TEXT)
    step_4 = wsd_on_bytes / "checkpoints" / "step_00000004"
    args = [*TINY_GPT, *QUIET, "data.level=byte", "scheduler=wsd", "scheduler.warmup_steps=2", "trainer.max_steps=8",
            f"data.path={other}", f"resume={step_4}", f"hydra.run.dir={tmp_path / 'branch'}"]
    refused(run(args, check=False), f"data.path={other}", "trainer.resume_with_changed_data=true")
    assert not (tmp_path / "branch").exists()
    proc = run([*args, "trainer.resume_with_changed_data=true"])
    named(proc.stdout, f"override accepted: data.path: data/tinyshakespeare.txt -> {other}",
          "(epoch 1, 0 samples in)", "the best trainer.monitor value so far")
    lr_first, lr_branch = scalars(wsd_on_bytes, "train/lr"), scalars(tmp_path / "branch", "train/lr")
    assert sorted(lr_branch) == [5, 6, 7, 8] and all(lr_branch[s] == lr_first[s] for s in lr_branch)
    assert lr_branch[8] < lr_branch[5]  # its decay
    final = json.loads((tmp_path / "branch" / "checkpoints" / "step_00000008" / DATA_FILE).read_text())
    assert "file other.txt" in final and "file tinyshakespeare.txt" not in final


def test_a_resume_may_switch_to_another_data_option_whose_keys_replace_the_old_ones(wsd_on_bytes):
    from src.checkpointing.resume import config_for_resume
    from src.schema.complete import complete_config
    from tests.test_config import compose_train

    overrides = ["data=shards", "data.path=prepared", "trainer.resume_with_changed_data=true"]
    cfg = complete_config(compose_train([*TINY_GPT, *overrides]))
    resumed = config_for_resume(cfg, wsd_on_bytes / "checkpoints" / "step_00000004", overrides)
    assert resumed.data._target_ == "src.data.shards.ShardData" and resumed.data.path == "prepared"
    assert not {"level", "val_fraction", "tokenizer", "tokenizer_revision"} & set(resumed.data)  # TextData's own
    assert resumed.model.n_embd == 32 and resumed.scheduler.warmup_steps == 2  # the rest is the checkpoint's

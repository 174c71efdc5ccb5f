"""Bad input of every kind gets one clear message naming the key or the file and what is allowed.

Each row builds the data the way train.py does (`build`, which reports a user's mistake without Hydra's
wrapping). Configuration mistakes have their own table in test_config.py; a real launch of each kind is there
too (non-zero exit, no traceback, no run directory). Where each bad input of the faults issue is tested:

| bad input                                                    | test                                              |
|--------------------------------------------------------------|---------------------------------------------------|
| missing, empty, unreadable, too small for one window         | CASES below                                       |
| training set smaller than one global batch                   | test_a_training_set_smaller_than_one_global_batch |
| text that is not UTF-8; binary files of an impossible size   | CASES below                                       |
| token ids beyond the vocabulary                              | CASES below                                       |
| a missing mandatory value, an unknown option in any group    | test_config.py: test_bad_value_is_refused_...     |
| a model/data combination that cannot work (resnet on text)   | test_config.py: test_bad_value_is_refused_... and a real launch |
| an unwritable or impossible run directory                    | test_an_impossible_run_dir_is_refused_...         |
| eval_every or checkpoint_every beyond max_steps (warn)       | test_eval_or_checkpoint_intervals_longer_...      |
| a checkpoint whose model shape differs from the config       | test_checkpoint.py: test_resume_from_a_checkpoint_whose_model_shape_differs_... |
| a checkpoint with another global batch                       | test_checkpoint.py: test_resuming_with_another_global_batch_is_refused_... |
| a port already in use                                        | test_slurm.py: test_two_node_job_... (its port taken) |
| resume=PATH to something that is not a checkpoint            | test_resume_from_something_that_is_not_a_checkpoint_is_refused |
"""

import re

import numpy as np
import pytest
from omegaconf import OmegaConf

from src.errors import UsageError
from src.launch.hydra_hooks import check_run_dir_can_be_made
from src.schema.build import build
from src.schema.complete import complete_config
from tests.conftest import named
from tests.test_config import compose_train


def write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


CASES = {
    "data path that is a directory": (lambda d: {"_target_": "src.data.text.TextData", "path": str(d),
                                                 "block_size": 8}, ("data.path='{d}'", "directory", "a file")),
    "missing text file": (lambda d: {"_target_": "src.data.text.TextData", "path": str(d / "none.txt"),
                                     "block_size": 8}, ("data.path='{d}/none.txt'", "no such file")),
    "empty text file": (lambda d: {"_target_": "src.data.text.TextData", "path": write(d / "e.txt", b""),
                                   "block_size": 8}, ("data.path={d}/e.txt", "0 tokens")),
    "text too small for one window": (lambda d: {"_target_": "src.data.text.TextData",
                                                 "path": write(d / "s.txt", b"hello"), "block_size": 8},
                                      ("data.block_size=8",)),
    "text that is not UTF-8": (lambda d: {"_target_": "src.data.text.TextData",
                                          "path": write(d / "l.txt", b"caf\xe9 " * 100), "block_size": 8},
                               ("UTF-8", "0xe9", "offset 3", "data.level=byte")),
    "token file of an odd size": (lambda d: {"_target_": "src.data.text.TokenData", "path": write(d / "t.bin", b"abc"),
                                             "vocab_size": 256, "block_size": 8},
                                  ("data.path={d}/t.bin", "3 bytes", "2")),
    "token ids beyond the vocabulary": (
        lambda d: {"_target_": "src.data.text.TokenData", "vocab_size": 10, "block_size": 8,
                   "path": write(d / "v.bin", np.arange(200, dtype=np.uint16).tobytes())},
        ("data.vocab_size=10", "{d}/v.bin", "199")),
    "CIFAR directory without its files": (lambda d: {"_target_": "src.data.cifar10.Cifar10Data", "root": str(d)},
                                          ("{d}", "CIFAR-10")),
    "CIFAR file of the wrong size": (
        lambda d: {"_target_": "src.data.cifar10.Cifar10Data", "root": str(d),
                   **{"_": [write(d / "data_batch_1.bin", b"x" * 3073 * 2 + b"y"), write(d / "test_batch.bin", b"")]}},
        ("{d}/data_batch_1.bin", "6147", "3073")),
    "JSON Lines file with a broken line": (
        lambda d: {"_target_": "src.data.jsonl.JsonlData", "block_size": 8,
                   "path": write(d / "b.jsonl", b'{"text": "a b"}\nnot json\n')},
        ("{d}/b.jsonl:2", "JSON", "column 1")),
    "JSON Lines file without the text key": (
        lambda d: {"_target_": "src.data.jsonl.JsonlData", "block_size": 8,
                   "path": write(d / "k.jsonl", b'{"body": "a b"}\n')},
        ("{d}/k.jsonl:1", "'text'", "data.text_key", "['body']")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_is_reported_naming_the_file_or_key_and_what_is_allowed(tmp_path, case):
    make_node, names = CASES[case]
    node = make_node(tmp_path)
    node.pop("_", None)  # files the case wrote, not a parameter
    with pytest.raises(UsageError) as refused:
        build(OmegaConf.create(node), group="data")
    named(str(refused.value), *(name.format(d=tmp_path) for name in names))


@pytest.mark.parametrize("content", [b"caf\xe9 " * 100,  # not UTF-8
                                     "".join(map(chr, range(0x10000, 0x20001))).encode()])  # 65,537 characters
def test_text_that_characters_cannot_tokenize_trains_at_the_level_its_refusal_suggests(tmp_path, content):
    node = {"_target_": "src.data.text.TextData", "path": write(tmp_path / "t.txt", content), "block_size": 8}
    with pytest.raises(UsageError) as refused:
        build(OmegaConf.create(node), group="data")
    key, value = re.search(r"use data\.(\w+)=(\w+)", str(refused.value)).groups()  # as a user types it
    assert build(OmegaConf.create({**node, key: value}), group="data").train


def test_two_ways_of_randomising_windows_are_refused_and_each_alone_accepted():
    from src.data.text import TextData

    both = {"path": "data/tinyshakespeare.txt", "block_size": 64, "random_offset": True, "random_windows": True}
    with pytest.raises(ValueError) as refused:
        TextData(**both)
    named(str(refused.value), "data.random_offset=true", "data.random_windows=true")
    for key in ("random_offset", "random_windows"):  # "choose one", typed
        assert TextData(**{**both, key: False}).train


def test_a_batch_larger_than_the_training_set_is_refused():
    from src.data.text import TextData

    with pytest.raises(UsageError) as refused:
        TextData(path="data/tinyshakespeare.txt", block_size=64, batch_size=100000).train_dataloader()
    named(str(refused.value), "data.batch_size=100000", "training set")


def test_a_training_set_smaller_than_one_global_batch():
    from src.loop.accumulation import steps_per_epoch
    from src.loop.train_state import TrainState

    layout = TrainState(batch_size=4, num_processes=2, gradient_accumulation_steps=3)
    with pytest.raises(UsageError) as refused:
        steps_per_epoch(range(20), layout.global_batch, layout.layout())
    named(str(refused.value), "20 samples", "24", "data.batch_size=4", "2 process",
          "trainer.gradient_accumulation_steps=3", "lower data.batch_size")
    assert steps_per_epoch(range(50), 24, layout.layout()) == 2  # whole global batches only


@pytest.mark.parametrize("run_dir, message", [("/proc/no/run", "/proc is not writable"),
                                              ("README.md/run", "README.md is not a directory")])
def test_an_impossible_run_dir_is_refused_before_hydra_creates_it(run_dir, message):
    with pytest.raises(UsageError, match=rf"hydra.run.dir={run_dir} cannot be created: .*{message}"):
        check_run_dir_can_be_made(run_dir)


def test_eval_or_checkpoint_intervals_longer_than_the_run_warn():
    warnings = []
    complete_config(compose_train(["trainer.max_steps=5", "trainer.eval_every=10", "trainer.checkpoint_every=20",
                                   "scheduler.warmup_steps=1"]), warnings)
    named("\n".join(warnings), "trainer.eval_every=10", "trainer.checkpoint_every=20", "trainer.max_steps=5")


def test_resume_from_something_that_is_not_a_checkpoint_is_refused(tmp_path):
    from src.checkpointing.resume import resume_source

    with pytest.raises(UsageError, match=r"resume=.*: not a checkpoint directory"):
        resume_source(str(tmp_path), tmp_path / "run")

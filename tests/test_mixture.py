"""data=mixture: several datasets in one run, each drawn in proportion to its weight, reproducibly by seed and
epoch; resumed bitwise (and on another number of processes, as one dataset is); every source fingerprinted."""

import json
from collections import Counter

import pytest
import torch

from src.errors import UsageError
from tests.conftest import QUIET, ROOT, exported_weights, kill_when, max_abs_diff, named, refused, run, scalars

datasets = pytest.importorskip("datasets")


def test_shares_follow_the_weights_and_add_up():
    from src.data.mixture import shares

    assert shares([3, 1], 4200) == [3150, 1050]
    assert shares([1, 1, 1], 10) == [4, 3, 3] and sum(shares([0.2, 0.7, 0.1], 999)) == 999


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n: int, tag: str):
        self.n, self.tag = n, tag

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (self.tag, i)


def test_each_epoch_takes_each_sources_share_and_walks_a_source_through_whole_passes_before_repeating():
    from src.data.mixture import MixedSamples

    small, large = Numbers(10, "small"), Numbers(100, "large")
    mixed = MixedSamples([small, large], [25, 30], seed=0)  # the small source drawn 2.5 times, the large 0.3
    epochs = []
    for epoch in range(4):
        mixed.set_epoch(epoch)
        epochs.append([mixed[i] for i in range(len(mixed))])
        assert Counter(tag for tag, _ in epochs[-1]) == {"small": 25, "large": 30}
    small_walk = [i for epoch in epochs for tag, i in epoch if tag == "small"]
    for lap in range(10):  # 100 draws of 10 samples: every lap a whole pass, in its own order
        assert sorted(small_walk[lap * 10 : lap * 10 + 10]) == list(range(10))
    large_walk = [i for epoch in epochs[:3] for tag, i in epoch if tag == "large"]
    assert len(set(large_walk)) == 90  # three epochs of 30: no sample twice before a whole pass
    again = MixedSamples([small, large], [25, 30], seed=0)
    again.set_epoch(3)
    assert [again[i] for i in range(len(again))] == epochs[3]  # a function of (seed, epoch) alone, held nowhere
    other = MixedSamples([small, large], [25, 30], seed=1)
    other.set_epoch(3)
    assert [other[i] for i in range(len(other))] != epochs[3]


@pytest.fixture
def two_sources(tmp_path) -> list:
    """Two datasets of different sizes and columns: speeches (text) and numbered lines (body)."""
    speeches = [json.loads(line)["text"] for line in open(ROOT / "data" / "shakespeare_speeches.jsonl")][:300]
    datasets.Dataset.from_dict({"text": speeches}).to_parquet(str(tmp_path / "speeches.parquet"))
    lines = [f"line {i}: " + "to be or not to be " * (1 + i % 5) for i in range(100)]
    datasets.Dataset.from_dict({"body": lines}).to_json(str(tmp_path / "lines.jsonl"))
    return [{"path": str(tmp_path / "speeches.parquet"), "weight": 3},
            {"path": str(tmp_path / "lines.jsonl"), "text_column": "body", "weight": 1}]


def test_a_mixture_reads_each_source_with_its_own_keys_and_fingerprints_every_sources_files(two_sources):
    from src.data.mixture import Mixture

    data = Mixture(sources=two_sources, block_size=32, batch_size=4, samples_per_epoch=400)
    assert len(data.train) == 400 and data.train.counts == [300, 100] and len(data.val) == 30 + 10
    texts = Counter(bytes(data.train[i]["input_ids"].tolist()).startswith(b"line ") for i in range(400))
    assert texts == {False: 300, True: 100}
    files = [key for key in data.fingerprint() if key.startswith("file ")]
    assert files == ["file source 0 speeches.parquet", "file source 1 lines.jsonl"]


def test_the_summary_counts_the_tokens_each_source_gave_the_batches_the_run_took(two_sources):
    """Replayed from the seeded sampler's order, across an epoch boundary: the tokens of the batches themselves
    (source 1's samples are the ones starting 'line '; padding is byte 0, which no text holds)."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    from src.data.mixture import Mixture
    from src.loop.accumulation import accumulation_windows, steps_per_epoch
    from src.loop.train_state import TrainState

    data = Mixture(sources=two_sources, block_size=32, batch_size=4, samples_per_epoch=40)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    try:
        loader = accelerator.prepare(data.train_dataloader())
        state = TrainState(batch_size=4, num_processes=1, gradient_accumulation_steps=2)
        epoch_steps = steps_per_epoch(loader.dataset, 8, "layout")  # 5 steps of 8 samples
        seen = [0, 0]
        for window in accumulation_windows(accelerator, loader, state, 7, 2, epoch_steps):
            state.step += 1
            for row in torch.cat([batch["input_ids"] for batch in window]):
                seen[bytes(row[:5].tolist()) == b"line "] += int((row != 0).sum())
        assert (state.epoch, state.samples_into_epoch) == (1, 16) and seen[0] and seen[1]
        counted = data.consumed(loader, state, epoch_steps * 8)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert list(counted.values()) == seen
    assert list(counted) == [f"tokens from data.sources[{i}] ({source['path']})" for i, source in enumerate(two_sources)]


@pytest.mark.parametrize("change, names", [
    ({"colum": "body"}, ["data.sources[1]", "'colum'", "text_column"]),
    ({"weight": 0}, ["data.sources[1].weight=0", "above 0"]),
    ({"text_column": "nothing"}, ["data.sources[1]", "lines.jsonl", "data.text_column=nothing", "body"]),
])
def test_a_source_with_an_unknown_key_or_a_bad_weight_or_column_is_refused_naming_it(two_sources, change, names):
    from src.data.mixture import Mixture

    two_sources[1].update(change)
    with pytest.raises(UsageError) as error:
        Mixture(sources=two_sources, block_size=32, batch_size=4)
    named(str(error.value), *names)


def mixture_args(sources: list, run_dir, dropout: float = 0.1) -> list[str]:
    listed = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in source.items()) + "}" for source in sources)
    return ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", f"model.dropout={dropout}",
            "data=mixture", f"data.sources=[{listed}]", "data.samples_per_epoch=64", "objective=causal_lm",
            "data.batch_size=4", "trainer.max_steps=12", "trainer.checkpoint_every=6", "trainer.monitor=null",
            *QUIET, f"hydra.run.dir={run_dir}"]


@pytest.mark.parametrize("dropout, nproc, accumulation", [(0.1, 1, 2), (0.0, 2, 1)], ids=["same", "two_processes"])
def test_a_killed_mixture_run_resumes_to_the_uninterrupted_training(tmp_path, two_sources, dropout, nproc,
                                                                     accumulation):
    """Across an epoch boundary (64 samples: 8 steps of 8 samples). Resumed on 1 process, with dropout on: the
    uninterrupted run's losses and weights bitwise. On 2 processes (a new split of the same global batch, so a
    new random stream: no dropout), within float rounding, as one dataset resumes."""
    args = [*mixture_args(two_sources, tmp_path / "uninterrupted", dropout), "trainer.gradient_accumulation_steps=2"]
    run(args)
    run_dir = tmp_path / "killed"
    args = [*mixture_args(two_sources, run_dir, dropout)]
    kill_when([*args, "trainer.gradient_accumulation_steps=2"], 1,
              ready=lambda: (run_dir / "checkpoints" / "step_00000006").is_dir())
    run([*args, f"trainer.gradient_accumulation_steps={accumulation}", "resume=auto"], nproc=nproc)
    expected, got = scalars(tmp_path / "uninterrupted", "train/loss"), scalars(run_dir, "train/loss")
    assert sorted(got) == list(range(1, 13))
    weights = max_abs_diff(exported_weights(tmp_path / "uninterrupted"), exported_weights(run_dir))
    if nproc == 1:
        assert got == expected and weights == 0
    else:
        assert max(abs(got[step] - expected[step]) for step in expected) <= 1e-5 and weights <= 1e-5


def test_a_resume_after_one_source_changed_is_refused_naming_that_sources_file(tmp_path, two_sources):
    run_dir = tmp_path / "run"
    args = [*mixture_args(two_sources, run_dir), "trainer.max_steps=6"]
    run(args)
    lines = tmp_path / "lines.jsonl"
    lines.write_text(lines.read_text().replace("to be", "to do"))
    proc = run([*mixture_args(two_sources, run_dir), "trainer.max_steps=12", "resume=auto"], check=False)
    refused(proc, "file source 1 lines.jsonl", "trainer.resume_with_changed_data=true")

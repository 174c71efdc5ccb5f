"""The shuffle of very large datasets (src/data/sampling.py): an order computed as the loader asks for it."""

import numpy as np
import pytest

from src.data.sampling import Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 8193, 65537])
def test_every_epoch_visits_every_index_once(n):
    for epoch in range(3):
        sampler = Permutation(n, seed=7)
        sampler.set_epoch(epoch)
        assert sorted(sampler) == list(range(n)) and len(sampler) == n


def test_the_order_is_a_function_of_seed_and_epoch_alone():
    def order(seed, epoch):
        sampler = Permutation(5000, seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(3, 1) == order(3, 1)  # another rank, or a resumed run, draws the same order
    assert order(3, 1) != order(3, 2) and order(3, 1) != order(4, 1)
    assert order(3, 1) != list(range(5000))


def test_the_order_is_well_mixed():
    # Neighbours in the order are far apart in the dataset, as a random permutation's are (mean gap n/3).
    first = np.array(list(Permutation(100_000, seed=0)))
    gaps = np.abs(np.diff(first))
    assert 0.3 < gaps.mean() / 100_000 < 0.37
    # and positions are uncorrelated with indices
    assert abs(np.corrcoef(np.arange(100_000), first)[0, 1]) < 0.02


def test_the_first_index_of_an_epoch_of_a_trillion_samples_is_drawn_without_listing_the_epoch():
    sampler = Permutation(2**40, seed=1)
    first = next(iter(sampler))
    assert 0 <= first < 2**40  # torch's sampler would first list the 2**40 indices: 8 TiB


def test_one_position_drawn_alone_is_where_the_epochs_order_puts_it():
    """at(k), in Python integers for a mixture's one sample at a time, is the vectorised order's k-th index."""
    for n, seed, epoch in ((1, 0, 0), (17, 3, 2), (65537, 7, 1), (2**40 + 3, 1, 5)):
        sampler = Permutation(n, seed)
        sampler.set_epoch(epoch)
        positions = np.unique(np.random.default_rng(n).integers(0, n, 200, dtype=np.uint64))
        with np.errstate(over="ignore"):
            expected = sampler.permute(positions).tolist()
        assert [sampler.at(int(k)) for k in positions] == expected


def test_repeated_windows_give_each_global_batch_of_a_shuffled_epoch_several_times_in_a_row():
    """objective.num_iterations: an epoch is each global batch of the epoch's shuffle `repeats` times in a row, every
    sample of its whole batches once per repeat, the tail left out; the order a function of (seed, epoch) alone."""
    from src.data.sampling import RepeatedWindows

    def epoch(seed: int, number: int) -> list[int]:
        windows = RepeatedWindows(list(range(23)), global_batch=4, repeats=3, seed=seed)
        windows.set_epoch(number)
        return [windows[k] for k in range(len(windows))]

    order = epoch(7, 0)
    assert len(order) == 5 * 4 * 3  # 5 whole batches of 4 (3 samples wait for later epochs), each 3 times
    batches = [order[i:i + 4] for i in range(0, len(order), 4)]
    assert all(batches[i] == batches[i - i % 3] for i in range(len(batches)))
    assert len({sample for batch in batches for sample in batch}) == 20
    assert epoch(7, 0) == order and epoch(7, 1) != order and epoch(8, 0) != order

"""A shuffle that holds no list of the epoch's order, for datasets of millions of samples and more.

torch's RandomSampler (and accelerate's seedable one, which the template uses for other data) draws
`torch.randperm(n).tolist()` each epoch: 3.9M windows of a 1B-token corpus cost 0.3 GiB and a second before the first
step, 4B windows would cost 150 GiB. Here sample k of an epoch is a keyed bijection of k (a Feistel network over the
next power of four, walking its cycle back into [0, n)), computed in blocks as the loader asks: constant memory and
start-up, the same order on every rank and after a resume, a function of (seed, epoch) alone.
"""

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Dataset, Sampler

_ROUNDS = 4
_BLOCK = 8192


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic), as src/data/text.py's on one integer."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """_mix on one Python integer, wrapping at 64 bits as numpy's uint64 does."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


_U64 = (1 << 64) - 1


class Permutation(Sampler[int]):
    """Indices 0..n-1 in an order drawn from (seed, epoch); `set_epoch` as accelerate's samplers have it."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0
        self._keys_of, self._int_keys = None, []  # at()'s round keys, for (seed, epoch)
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # the domain is 4**half >= n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def _keys(self) -> list[np.uint64]:
        base = _mix(np.array([(self.seed * 1_000_003 + self.epoch) % 2**64], dtype=np.uint64))[0]
        return [_mix(np.array([base ^ np.uint64(r)], dtype=np.uint64))[0] for r in range(_ROUNDS)]

    def permute(self, k: np.ndarray) -> np.ndarray:
        """Where positions k (uint64, each < n) of the epoch's order point."""
        keys, half = self._keys(), np.uint64(self.half)
        mask = np.uint64((1 << self.half) - 1)

        def feistel(x: np.ndarray) -> np.ndarray:
            left, right = x >> half, x & mask
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & mask)
            return (left << half) | right

        x = feistel(k)
        outside = x >= self.n
        while outside.any():  # cycle walking: a bijection on the domain restricted to [0, n) stays one
            x[outside] = feistel(x[outside])
            outside = x >= self.n
        return x

    def at(self, k: int) -> int:
        """permute() of one position in Python integers (the same arithmetic, 20x faster than numpy on one value):
        a mixture draws its sources' samples one at a time (src/data/mixture.py)."""
        if self._keys_of != (self.seed, self.epoch):
            self._keys_of, self._int_keys = (self.seed, self.epoch), [int(key) for key in self._keys()]
        half, mask = self.half, (1 << self.half) - 1

        def feistel(x: int) -> int:
            left, right = x >> half, x & mask
            for key in self._int_keys:
                left, right = right, left ^ (_mix_int(right ^ key) & mask)
            return (left << half) | right

        x = feistel(k)
        while x >= self.n:  # cycle walking, as permute()
            x = feistel(x)
        return x

    def __iter__(self) -> Iterator[int]:
        for start in range(0, self.n, _BLOCK):
            # Not around the yield: data.read_ahead resumes this generator in another thread, whose context
            # numpy's errstate could not restore.
            with np.errstate(over="ignore"):
                block = self.permute(np.arange(start, min(start + _BLOCK, self.n), dtype=np.uint64)).tolist()
            yield from block


class RepeatedWindows(Dataset):
    """An epoch whose every global batch comes `repeats` times in a row, for an objective that takes several
    optimizer steps on one batch of samples (objective=grpo's num_iterations; TRL's RepeatSampler). Position k of an
    epoch is sample order[(k // (G x repeats)) x G + k % G] of a shuffle drawn from (seed, epoch) alone, G the global
    batch: a function of the position, as a resume mid-epoch on any layout of G needs. Whole global batches only (the
    tail of fewer than G samples waits for later epochs' shuffles, as without repeats); read it in order."""

    def __init__(self, dataset: Dataset, global_batch: int, repeats: int, seed: int):
        self.dataset, self.global_batch, self.repeats = dataset, global_batch, repeats
        self.order = Permutation(len(dataset), seed)

    def __len__(self) -> int:
        return len(self.dataset) // self.global_batch * self.global_batch * self.repeats

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __getitem__(self, k: int):
        batch, within = divmod(k, self.global_batch * self.repeats)
        return self.dataset[self.order.at(batch * self.global_batch + within % self.global_batch)]

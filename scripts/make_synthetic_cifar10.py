"""Write a small CIFAR-10-format dataset of procedurally drawn images, for offline runs and tests.

    python scripts/make_synthetic_cifar10.py data/cifar-10-batches-bin
    accelerate launch train.py experiment=cifar10_resnet data.root=data/cifar-10-batches-bin

Each class is a shape (disc, square, ring, cross, bars, ...) with its own hue family, drawn at a random
position, size and colour jitter over a textured background: structure a ResNet has to learn (colour
alone does not separate the classes), deterministic for a given seed. Same files as the real dataset:
data_batch_{1..5}.bin and test_batch.bin, records of 1 label byte + 3072 bytes (R, G, B planes of 32x32).
"""

import argparse
from pathlib import Path

import numpy as np

SIZE = 32


def draw(label: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[:SIZE, :SIZE].astype(np.float32)
    cy, cx = rng.uniform(10, 22, size=2)
    r = rng.uniform(5, 9)
    dy, dx = yy - cy, xx - cx
    dist = np.hypot(dy, dx)
    shapes = [
        dist < r,  # disc
        (abs(dy) < r * 0.8) & (abs(dx) < r * 0.8),  # square
        (dist < r) & (dist > r * 0.55),  # ring
        (abs(dy) < r * 0.3) | (abs(dx) < r * 0.3),  # cross
        np.sin(xx * 0.9 + rng.uniform(0, 6)) > 0.3,  # vertical bars
        np.sin(yy * 0.9 + rng.uniform(0, 6)) > 0.3,  # horizontal bars
        abs(dy - dx) < 2.5,  # diagonal
        (dy > -r) & (dy < r) & (abs(dx) < (dy + r) * 0.5),  # triangle
        abs(dist - r) < 1.5 * ((np.arctan2(dy, dx) > 0) + 0.0),  # half ring
        np.sin(dist * 1.2) > 0.4,  # concentric rings
    ]
    mask = shapes[label].astype(np.float32)
    # Two hue families shared by five classes each, so shape (not colour) decides the label.
    base = np.array([0.85, 0.3, 0.2]) if label % 2 == 0 else np.array([0.2, 0.45, 0.85])
    colour = np.clip(base + rng.normal(0, 0.12, 3), 0, 1)
    background = rng.uniform(0.1, 0.5, 3)[:, None, None] + rng.normal(0, 0.06, (3, SIZE, SIZE))
    image = background * (1 - mask) + colour[:, None, None] * mask + rng.normal(0, 0.04, (3, SIZE, SIZE))
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def write_batch(path: Path, n: int, rng: np.random.Generator) -> None:
    labels = rng.integers(0, 10, n)
    records = np.empty((n, 1 + 3 * SIZE * SIZE), dtype=np.uint8)
    for i, label in enumerate(labels):
        records[i, 0] = label
        records[i, 1:] = draw(int(label), rng).reshape(-1)
    records.tofile(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--train-per-batch", type=int, default=1000, help="images in each of the 5 train files")
    parser.add_argument("--test", type=int, default=1001, help="images in test_batch.bin (odd on purpose)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    args.root.mkdir(parents=True, exist_ok=True)
    for i in range(1, 6):
        write_batch(args.root / f"data_batch_{i}.bin", args.train_per_batch, rng)
    write_batch(args.root / "test_batch.bin", args.test, rng)
    print(f"wrote {5 * args.train_per_batch} training and {args.test} test images to {args.root}")


if __name__ == "__main__":
    main()

"""Write a text file as a flat uint16 token file (nanoGPT's .bin format) for `data=tokens`.

    python scripts/prepare_tokens.py data/tinyshakespeare.txt data/shakespeare_bytes.bin
    accelerate launch train.py data=tokens data.path=data/shakespeare_bytes.bin data.vocab_size=256

Byte-level ids (0..255) keep this dependency-free; for BPE use nanoGPT's prepare.py with tiktoken,
which writes the same format (vocab_size 50257).
"""

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text_file", type=Path)
    parser.add_argument("bin_file", type=Path)
    args = parser.parse_args()
    tokens = np.frombuffer(args.text_file.read_bytes(), dtype=np.uint8).astype(np.uint16)
    args.bin_file.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(args.bin_file)
    print(f"wrote {len(tokens):,} tokens (vocab_size=256) to {args.bin_file}")


if __name__ == "__main__":
    main()

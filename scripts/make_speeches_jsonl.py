"""Cut tiny Shakespeare into one JSON Lines document per speech (speeches are separated by blank lines).

    python scripts/make_speeches_jsonl.py data/tinyshakespeare.txt data/shakespeare_speeches.jsonl --max 3000

This is how data/shakespeare_speeches.jsonl, the offline sample of data=jsonl, was made.
"""

import argparse
import json

parser = argparse.ArgumentParser()
parser.add_argument("text")
parser.add_argument("output")
parser.add_argument("--max", type=int, default=None, help="keep the first N speeches")
args = parser.parse_args()

with open(args.text, encoding="utf-8") as f:
    speeches = [s.strip() for s in f.read().split("\n\n") if s.strip()][: args.max]
with open(args.output, "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": s}) + "\n" for s in speeches)
print(f"{len(speeches)} documents -> {args.output}")

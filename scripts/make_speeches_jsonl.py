"""Cut tiny Shakespeare into one JSON Lines document per speech (speeches are separated by blank lines), into
short conversations of four speeches whose turns alternate between a user and an assistant, or into preference
pairs: a speech as the prompt, the speech that answers it as the chosen answer, and that answer with its words
shuffled (seeded) as the rejected one.

    python scripts/make_speeches_jsonl.py data/tinyshakespeare.txt data/shakespeare_speeches.jsonl --max 3000
    python scripts/make_speeches_jsonl.py data/tinyshakespeare.txt data/shakespeare_dialogues.jsonl --dialogues 300
    python scripts/make_speeches_jsonl.py data/tinyshakespeare.txt data/shakespeare_pairs.jsonl --pairs 600

This is how data/shakespeare_speeches.jsonl, the offline sample of data=jsonl, and
data/shakespeare_dialogues.jsonl, its multi-turn chats (`data.text_key=messages`), and data/shakespeare_pairs.jsonl,
its preference pairs (`data.preference=true`, objective=dpo), were made.
"""

import argparse
import json
import random

parser = argparse.ArgumentParser()
parser.add_argument("text")
parser.add_argument("output")
parser.add_argument("--max", type=int, default=None, help="keep the first N speeches")
parser.add_argument("--dialogues", type=int, default=None,
                    help="write N conversations of 4 consecutive speeches of under 100 characters each instead")
parser.add_argument("--pairs", type=int, default=None,
                    help="write N preference pairs of consecutive speeches of under 80 characters each instead")
args = parser.parse_args()

with open(args.text, encoding="utf-8") as f:
    speeches = [s.strip() for s in f.read().split("\n\n") if s.strip()][: args.max]
documents, i = [], 0
if args.dialogues is None and args.pairs is None:
    documents = [{"text": s} for s in speeches]
shuffler = random.Random(0)
for cue, reply in zip(speeches, speeches[1:]):
    if args.pairs is None or len(documents) == args.pairs:
        break
    speaker, _, words = reply.partition("\n")
    shuffled = words.split()
    shuffler.shuffle(shuffled)
    if len(cue) < 80 and len(reply) < 80 and len(shuffled) > 2 and shuffled != words.split():
        documents.append({"prompt": cue + "\n\n", "chosen": reply, "rejected": speaker + "\n" + " ".join(shuffled)})
while args.dialogues is not None and len(documents) < args.dialogues and i + 4 <= len(speeches):
    turns = speeches[i : i + 4]
    if all(len(s) < 100 for s in turns):
        documents.append({"messages": [{"role": role, "content": s}
                                       for role, s in zip(["user", "assistant"] * 2, turns)]})
        i += 4
    else:
        i += 1
with open(args.output, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(d) + "\n" for d in documents)
print(f"{len(documents)} documents -> {args.output}")

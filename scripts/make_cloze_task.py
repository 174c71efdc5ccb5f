"""Writes data/eval_tasks/shakespeare_cloze.jsonl: a downstream task over tiny Shakespeare's validation text (its
last 10%, which no run trains on), for trainer.eval_tasks (data/eval_tasks/shakespeare_cloze.yaml, an
lm-evaluation-harness task). Each document is two lines of a speech and the start of the third; the choices are
that line's true ending and the endings of three other lines of the same text. A model that has learnt the
play's language picks the true one more often than a quarter of the time.

    python scripts/make_cloze_task.py
"""

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS, CHOICES, SEED = 200, 4, 1234


def main() -> None:
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    validation = text[int(len(text) * 0.9):]  # data=text's validation split (data.val_fraction=0.1)
    lines = validation.split("\n")
    usable = [i for i in range(2, len(lines)) if len(lines[i]) >= 30 and lines[i - 1] and lines[i - 2]]
    rng = random.Random(SEED)
    chosen = rng.sample(usable, DOCUMENTS)
    with open(ROOT / "data" / "eval_tasks" / "shakespeare_cloze.jsonl", "w") as out:
        for i in chosen:
            cut = len(lines[i]) // 2
            context = "\n".join(lines[i - 2 : i]) + "\n" + lines[i][:cut]
            others = rng.sample([j for j in usable if j != i], CHOICES - 1)
            endings = [lines[i][cut:]] + [lines[j][len(lines[j]) // 2 :] for j in others]
            order = list(range(CHOICES))
            rng.shuffle(order)
            out.write(json.dumps({"context": context, "choices": [endings[k] for k in order],
                                  "answer": order.index(0)}) + "\n")


if __name__ == "__main__":
    main()

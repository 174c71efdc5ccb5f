"""Reward functions for objective=grpo (`objective.reward=src.objectives.rewards.NAME`), and the form yours takes.

A reward function has TRL's GRPOTrainer signature:

    def my_reward(prompts: list, completions: list[str], **columns) -> list[float]

one float per completion. `prompts` are the data's prompts as its file writes them (strings or message lists), one
per completion (a prompt's group repeats it); `completions` the texts the model wrote; `columns` the data's other
columns, each a list aligned with the completions (take the ones you need by name and let **columns hold the rest).
It runs on every process, on that process's completions, between the generation and the backward pass: keep it
fast, or it is the step's time. Put yours in any importable module and name it: objective.reward=my_module.my_reward.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def final_number(prompts: list, completions: list[str], answer: list, **columns) -> list[float]:
    """1 where the completion's first line ends in the number the row's `answer` ends in, else 0: a verifiable
    reward for arithmetic and GSM8K-style data (whose answers end "#### 72")."""
    scores = []
    for completion, expected in zip(completions, answer):
        given = last_number(completion.split("\n", 1)[0])
        scores.append(float(given is not None and given == last_number(str(expected))))
    return scores

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


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text.replace(",", ""))  # 1,072 is one number


def final_of(text: str) -> float | None:
    """The first number after the text's last "####" where it has one, else its last number."""
    marked = text.rsplit("####", 1)
    found = numbers(marked[1])[:1] if len(marked) == 2 else []
    found = found or numbers(text)[-1:]
    return float(found[0]) if found else None


def final_number(prompts: list, completions: list[str], answer: list, **columns) -> list[float]:
    """1 where the completion's final number equals the row's `answer`'s, else 0 (72.0 is 72): a verifiable reward
    for arithmetic and GSM8K (whose answers end "#### 72"). A text's final number is the first after its last "####"
    where it writes one, else its last number."""
    scores = []
    for completion, expected in zip(completions, answer):
        given = final_of(completion)
        scores.append(float(given is not None and given == final_of(str(expected))))
    return scores

"""Reward functions the GRPO tests train with (objective.reward=tests.grpo_rewards.NAME)."""


def letter_share(prompts: list, completions: list[str], letter: list, **columns) -> list[float]:
    """The share of the completion's characters that are the row's `letter`: dense enough that a model learns
    it from scratch in a few dozen steps."""
    return [sum(ch == want for ch in text) / max(len(text), 1) for text, want in zip(completions, letter)]


def too_few(prompts: list, completions: list[str], **columns) -> list[float]:
    """A broken reward: one score short."""
    return [0.0] * (len(completions) - 1)


def starts_with_letter(prompts: list, completions: list[str], letter: list, **columns) -> list[float]:
    """1 where the completion starts with the row's letter."""
    return [float(text.startswith(want)) for text, want in zip(completions, letter)]

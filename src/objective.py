"""How a batch becomes a loss and metrics, for any model that maps inputs to logits over classes.

Next-token logits (B, T, V) with targets (B, T) and class logits (B, C) with targets (B,) both work.
"""

import torch
import torch.nn.functional as F


def per_sample_loss_and_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and accuracy per sample (averaged over its tokens), in fp32 whatever the autocast dtype."""
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)
    correct = (logits.argmax(-1) == targets).float()
    dims = tuple(range(1, targets.dim()))
    return (loss.mean(dims), correct.mean(dims)) if dims else (loss, correct)


def training_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over every prediction of the batch (samples have equal token counts)."""
    inputs, targets = batch
    logits = model(inputs).float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())

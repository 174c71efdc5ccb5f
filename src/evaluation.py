"""Evaluation whose metrics are exact across processes: every validation sample counted exactly once."""

import torch
from accelerate import Accelerator

from src.objective import per_sample_loss_and_accuracy


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, accelerator: Accelerator) -> dict[str, float]:
    """Mean loss and accuracy over the whole validation set, and how many samples that was.

    Per-sample values go through `gather_for_metrics`, which drops the samples accelerate duplicated to
    even out the last batch across ranks (a per-batch mean would silently keep one rank's value there).
    """
    was_training = model.training
    model.eval()
    # Summed in float64 on the CPU: exact enough that 1 and N processes agree to ~1e-12, and MPS has no float64.
    loss_sum, correct_sum, count = 0.0, 0.0, 0
    for inputs, targets in loader:
        loss, accuracy = per_sample_loss_and_accuracy(model(inputs), targets)
        loss, accuracy = accelerator.gather_for_metrics((loss, accuracy))
        loss_sum += loss.cpu().double().sum().item()
        correct_sum += accuracy.cpu().double().sum().item()
        count += len(loss)
    model.train(was_training)
    return {"loss": loss_sum / count, "accuracy": correct_sum / count, "samples": count}

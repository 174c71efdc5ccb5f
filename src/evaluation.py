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
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, correct sum, count
    for inputs, targets in loader:
        loss, accuracy = per_sample_loss_and_accuracy(model(inputs), targets)
        loss, accuracy = accelerator.gather_for_metrics((loss, accuracy))
        totals += torch.stack([loss.double().sum(), accuracy.double().sum(), torch.tensor(len(loss), device=totals.device)])
    model.train(was_training)
    loss_sum, correct_sum, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct_sum / count, "samples": count}

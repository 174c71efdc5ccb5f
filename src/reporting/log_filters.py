"""Library log lines that are noise for this project, dropped without hiding real warnings."""

import logging
import re

import torch


class TiedWeightNotice(logging.Filter):
    """accelerate warns "Removed shared tensor {...} while saving" at every save of a model with tied weights
    (the GPT's lm_head is its token embedding): safetensors stores a shared tensor once, and loading ties it
    again. The notice is dropped for the model's own ties only; any other shared tensor is still reported."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.tied = every - {name for name, _ in model.named_parameters()}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Removed shared tensor" not in message:
            return True
        names = set(re.findall(r"'([^']+)'", message.split("while saving")[0]))
        return not names or not names <= {key for tied in self.tied for key in (tied, f"module.{tied}")}


def hide_tied_weight_notices(model: torch.nn.Module) -> None:
    logger = logging.getLogger("accelerate.utils.other")
    for earlier in [f for f in logger.filters if isinstance(f, TiedWeightNotice)]:  # an in-process sweep's last job
        logger.removeFilter(earlier)
    logger.addFilter(TiedWeightNotice(model))

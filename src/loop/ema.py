"""trainer.ema_decay: an exponential moving average of the weights, the model many recipes ship.

torch's own AveragedModel keeps it (one fused lerp over all tensors per optimizer step, buffers included,
so BatchNorm statistics are averaged too). Every rank keeps the same copy, because evaluation is sharded
over ranks. The checkpointer saves it as safetensors beside the training's state (not accelerate's
register_for_checkpointing, which pickles it), so a resumed run continues the same average bitwise.
"""

from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from src.errors import UsageError


def build_ema(accelerator: Accelerator, model: torch.nn.Module, decay: Optional[float]) -> Optional[AveragedModel]:
    """Call after accelerator.prepare and before the checkpointer loads (which restores it)."""
    if decay is None:
        return None
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UsageError(f"trainer.ema_decay needs whole weights on every rank; {accelerator.distributed_type} "
                         "shards them. Use DDP (config/accelerate/multi_gpu.yaml) or trainer.ema_decay=null.")
    ema = AveragedModel(accelerator.unwrap_model(model), multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema.requires_grad_(False)
    return ema

"""trainer.sync_batchnorm: BatchNorm statistics over the whole global batch under DDP.

Unsynced, each process normalises with the statistics of its own share of the batch, so a model trained on
8 GPUs x 4 samples sees noisier statistics than one on 1 GPU x 32 (and its running averages differ). On GPUs
this is torch's SyncBatchNorm. torch's refuses CPU tensors, so on CPU (gloo) `GlobalBatchNorm` makes the
same computation: per-channel sums and sums of squares all-reduced (differentiably) before normalising.
"""

import logging

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from accelerate import Accelerator
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

log = logging.getLogger(__name__)


class GlobalBatchNorm(_BatchNorm):
    """A BatchNorm (any dimensionality) whose training statistics come from every rank's samples."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {input.dim()}-D)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        local = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_tensor([x.numel() / channels])])
        total = dist_fn.all_reduce(local)  # a sum whose backward sums the gradients over ranks, as SyncBatchNorm's
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean  # biased, as BatchNorm normalises with
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(var * n / (n - 1), momentum)  # unbiased, as BatchNorm tracks
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y


def sync_batchnorm(model: nn.Module, accelerator: Accelerator) -> nn.Module:
    """Call before accelerator.prepare; a no-op on one process."""
    if accelerator.num_processes == 1:
        return model
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model) if accelerator.device.type != "cpu" else _convert(model)
    log.info("trainer.sync_batchnorm: BatchNorm statistics over all %d processes", accelerator.num_processes)
    return converted


def _convert(module: nn.Module) -> nn.Module:
    """SyncBatchNorm.convert_sync_batchnorm's recursion, to GlobalBatchNorm."""
    out = module
    if isinstance(module, _BatchNorm):
        out = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats)
        out.load_state_dict(module.state_dict())
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _convert(child))
    return out

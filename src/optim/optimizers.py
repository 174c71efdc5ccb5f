"""Optimizers, each a function whose signature holds this template's defaults and ranges (torch's own
classes work as `_target_` too; these exist so that our defaults are written once, beside the code).

Every optimizer option also takes LRScaling's keys (`optimizer.scale_lr`, `optimizer.reference_batch`),
whatever its `_target_`: the template applies them, since only it knows the global batch.
"""

import inspect
import logging
import math
from dataclasses import fields
from typing import Annotated, Literal, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from src.schema.build import build
from src.schema.signature import Arg, locate
from src.schema.trainer import LRScaling

log = logging.getLogger(__name__)


LR_SCALING_KEYS = tuple(f.name for f in fields(LRScaling))


def build_optimizer(node: DictConfig, model: nn.Module, global_batch: int) -> torch.optim.Optimizer:
    """The configured optimizer over param_groups(model), its learning rates scaled as optimizer.scale_lr says."""
    scaling = LRScaling(**{key: node[key] for key in LR_SCALING_KEYS if key in node})
    # An optimizer that treats layers differently (muon: the embeddings and the output layer apart) takes the model.
    takes_model = "model" in inspect.signature(locate(node["_target_"])).parameters
    optimizer = build({k: v for k, v in node.items() if k not in LR_SCALING_KEYS}, param_groups(model),
                      group="optimizer", **({"model": model} if takes_model else {}))
    if scaling.scale_lr != "none":
        ratio = global_batch / scaling.reference_batch
        factor = ratio if scaling.scale_lr == "linear" else math.sqrt(ratio)
        for group in optimizer.param_groups:
            group["lr"] *= factor  # before the scheduler is built: it takes these as its base rates
        log.info("optimizer.scale_lr=%s: global batch %d / reference %d -> learning rate x %.4g = %.4g",
                 scaling.scale_lr, global_batch, scaling.reference_batch, factor, optimizer.param_groups[0]["lr"])
    return optimizer


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices and conv kernels only; biases, norms and 1-D gains are left alone.

    The first group takes the optimizer's configured weight_decay; the second overrides it with 0.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(
    params,
    lr: Annotated[float, Arg("peak learning rate", gt=0)] = 1e-3,
    betas: Annotated[tuple[float, float], Arg("Adam's moment decay rates")] = (0.9, 0.99),
    weight_decay: Annotated[float, Arg("decoupled weight decay on matrices (not biases/norms)", ge=0)] = 0.1,
    eps: Annotated[float, Arg("Adam epsilon", gt=0)] = 1e-8,
    fused: Annotated[Optional[bool], Arg("fused kernel (null: on CUDA yes, elsewhere PyTorch's default)")] = None,
) -> torch.optim.AdamW:
    if fused is None and torch.cuda.is_available():
        fused = True  # one kernel for the whole update: the fastest AdamW on GPUs
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps, fused=fused)


def muon(
    params,
    model: nn.Module,
    lr: Annotated[float, Arg("peak learning rate of AdamW's parameters (embeddings, output layer, 1-D), and of "
                             "Muon's unless muon_lr says", gt=0)] = 1e-3,
    muon_lr: Annotated[Optional[float], Arg(
        "Muon's own peak learning rate (null: lr, which adjust_lr=match_rms_adamw makes fit: it scales each "
        "matrix's update to AdamW's size); with adjust_lr=original about 0.02", gt=0)] = None,
    weight_decay: Annotated[float, Arg("decoupled weight decay on matrices, Muon's and AdamW's (not biases/norms)",
                                       ge=0)] = 0.1,
    momentum: Annotated[float, Arg("Muon's momentum", ge=0, lt=1)] = 0.95,
    nesterov: Annotated[bool, Arg("Muon's Nesterov momentum")] = True,
    ns_steps: Annotated[int, Arg("Newton-Schulz iterations that orthogonalise each update", ge=1, lt=100)] = 5,
    adjust_lr: Annotated[Literal["match_rms_adamw", "original"], Arg(
        "how Muon scales a matrix's rate by its shape: match_rms_adamw (Moonshot's: 0.2 x sqrt(max side), AdamW's "
        "rate and decay carry over) or original (Keller Jordan's: sqrt(max(1, rows / columns)))")] = "match_rms_adamw",
    betas: Annotated[tuple[float, float], Arg("AdamW's moment decay rates")] = (0.9, 0.99),
    eps: Annotated[float, Arg("AdamW's epsilon", gt=0)] = 1e-8,
    fused: Annotated[Optional[bool], Arg("AdamW's fused kernel (null: on CUDA yes, elsewhere PyTorch's default)")
                     ] = None,
) -> torch.optim.Optimizer:
    """Muon on the hidden matrices, AdamW on the rest (src/optim/muon.py)."""
    from src.optim.muon import muon_with_adamw

    if fused is None and torch.cuda.is_available():
        fused = True
    return muon_with_adamw(
        model, params,
        muon=dict(lr=muon_lr or lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                  ns_steps=ns_steps, adjust_lr_fn=adjust_lr),
        adamw=dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps, fused=fused))


def sgd(
    params,
    lr: Annotated[float, Arg("peak learning rate", gt=0)] = 0.1,
    momentum: Annotated[float, Arg("momentum", ge=0, lt=1)] = 0.9,
    nesterov: Annotated[bool, Arg("Nesterov momentum")] = True,
    weight_decay: Annotated[float, Arg("L2 penalty on matrices (not biases/norms)", ge=0)] = 5e-4,
) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)

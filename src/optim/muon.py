"""Muon on a model's hidden matrices, AdamW on the rest (`optimizer=muon`): as modded-nanogpt trains GPT-2 and
Moonshot trains Moonlight.

Muon (torch.optim.Muon) replaces each matrix's momentum by its nearest orthogonal matrix (a few Newton-Schulz
iterations) before applying it; it is meant for the matrices between the embedding and the output layer. The
embedding tables, the output layer, and every parameter that is not a matrix (biases, norms, convolution kernels)
keep AdamW. The two are one optimizer here, because everything downstream wants one: accelerate's wrapper, the
learning-rate schedule (which scales every group's rate alike), gradient clipping, the pickle-free checkpoint
(src/checkpointing/plain_state.py) and a resume. Its param_groups are the union of both optimizers' groups (each
naming its `algorithm`) and its state is the one dict both update, so state_dict/load_state_dict are torch's own.

Newton-Schulz is most of Muon's cost (WholeMatrixMuon). Under DDP the ranks share it: each orthogonalises every
N-th matrix and broadcasts the results, applying the bits one process would compute. Under FSDP2 each matrix is
sharded across ranks, and its update is orthogonalised whole: a rank gathers one matrix's update at a time, runs
Newton-Schulz on it as one process would, and keeps its shard (every rank repeats that work; the memory beyond
the shards is one matrix).
"""

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from src.errors import UsageError

log = logging.getLogger(__name__)


class WholeMatrixMuon(torch.optim.Muon):
    """torch's Muon, with its Newton-Schulz work shared among processes and each matrix orthogonalised whole.

    Replicated weights (one process, DDP): every rank holds the same averaged gradient, so rank r orthogonalises
    matrices r, r + N, r + 2N... of each group and broadcasts each result to the others (modded-nanogpt's way):
    a rank does 1/N of the work, and every rank applies the same bits it would have computed itself.
    Sharded weights (FSDP2 DTensors): each matrix's update is gathered and orthogonalised whole on every rank,
    which keeps its shard. torch's Muon would run Newton-Schulz on the DTensors: the same maths, but its matrix
    products reduce bf16 partial sums across ranks at every iteration (measured: 5e-5 apart from one process after
    one step where DDP is bitwise) and communicate at each. The update is torch's _single_tensor_muon line for
    line, with the sharing around its Newton-Schulz."""

    @torch.no_grad()
    def step(self, closure=None):
        sharded = any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"])
        processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if processes == 1 and not sharded:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            updates = []
            for grad, buffer in zip(grads, buffers):
                buffer.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
            settings = group["ns_coefficients"], group["ns_steps"], group["eps"]
            if sharded:
                orthogonal = [distribute_tensor(_zeropower_via_newtonschulz(update.full_tensor(), *settings),
                                                param.device_mesh, param.placements, src_data_rank=None)
                              for param, update in zip(params, updates)]
            else:
                orthogonal = shared_newton_schulz(updates, settings, dist.get_rank(), processes)
            for param, update in zip(params, orthogonal):
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def shared_newton_schulz(updates: list[torch.Tensor], settings: tuple, rank: int, processes: int
                         ) -> list[torch.Tensor]:
    """Every update orthogonalised, this rank computing those at positions rank, rank + processes, ... and
    receiving the others from the ranks that computed them. All ranks compute first and then exchange, so that
    none waits for another's Newton-Schulz before starting its own."""
    orthogonal = [_zeropower_via_newtonschulz(update, *settings).contiguous() if i % processes == rank else
                  torch.empty_like(update, dtype=torch.bfloat16) for i, update in enumerate(updates)]
    pending = [dist.broadcast(update, src=i % processes, async_op=True) for i, update in enumerate(orthogonal)]
    for work in pending:
        work.wait()
    return orthogonal


ALGORITHMS = {"muon": WholeMatrixMuon, "adamw": torch.optim.AdamW}


def kept_from_muon(model: nn.Module) -> dict[int, str]:
    """The matrices Muon leaves to AdamW, by id, with their names: the embedding tables and the output layer's
    weight (found as chunked losses find it: get_output_embeddings() or `lm_head`; else the last Linear the model
    registers, a classifier's head; tied to the embedding, it is that one)."""
    from src.objectives.chunked import output_layer

    kept = [module.weight for module in model.modules() if isinstance(module, nn.Embedding)]
    try:
        kept.append(output_layer(model).weight)
    except UsageError:
        kept += [module.weight for module in model.modules() if isinstance(module, nn.Linear)][-1:]
    names = {id(p): name for name, p in model.named_parameters()}
    return {id(weight): names.get(id(weight), "the output layer") for weight in kept}


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over groups that each name their `algorithm` ("muon" or "adamw"): stepping torch's Muon over
    the first kind and torch's AdamW over the second, with `settings[algorithm]` as each one's defaults."""

    def __init__(self, groups: list[dict], settings: dict[str, dict[str, Any]]):
        self.settings = settings
        super().__init__(groups, defaults={})
        self._link()

    def _link(self) -> None:
        """The two optimizers over this one's group dicts and state: built again after load_state_dict, which
        replaces both."""
        self.parts = []
        for algorithm, cls in ALGORITHMS.items():
            groups = [group for group in self.param_groups if group["algorithm"] == algorithm]
            if groups:
                part = cls(groups, **self.settings[algorithm])  # fills each group's keys it lacks, in place
                part.state = self.state
                self.parts.append(part)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss


def muon_with_adamw(model: nn.Module, groups: list[dict], muon: dict[str, Any], adamw: dict[str, Any]
                    ) -> MuonWithAdamW:
    """`groups` (src/optim/optimizers.py: param_groups, matrices then the rest) split for MuonWithAdamW: the
    hidden matrices to Muon, the embeddings, the output layer and the rest to AdamW, each keeping its group's
    settings (weight decay)."""
    kept = kept_from_muon(model)
    split = []
    for group in groups:
        hidden = [p for p in group["params"] if p.ndim == 2 and id(p) not in kept]
        others = [p for p in group["params"] if p.ndim != 2 or id(p) in kept]
        settings = {k: v for k, v in group.items() if k != "params"}
        split += [{**settings, "params": params, "algorithm": algorithm}
                  for algorithm, params in (("muon", hidden), ("adamw", others)) if params]
    if not any(group["algorithm"] == "muon" for group in split):
        raise UsageError(f"optimizer=muon: {type(model).__name__} has no hidden matrices to give Muon (2-D "
                         f"weights other than {', '.join(kept.values()) or 'none'}, which stay with AdamW): use "
                         f"optimizer=adamw")
    trained = {id(p) for group in groups for p in group["params"]}
    tensors = {algorithm: [p for g in split if g["algorithm"] == algorithm for p in g["params"]]
               for algorithm in ALGORITHMS}
    log.info("optimizer=muon: Muon on %d hidden matrices (%s parameters), AdamW on %d other tensors (%s parameters; "
             "the embeddings and output layer among them: %s)",
             len(tensors["muon"]), f"{sum(p.numel() for p in tensors['muon']):,}",
             len(tensors["adamw"]), f"{sum(p.numel() for p in tensors['adamw']):,}",
             ", ".join(name for key, name in kept.items() if key in trained) or "none trained")
    return MuonWithAdamW(split, {"muon": muon, "adamw": adamw})

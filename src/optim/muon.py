"""Muon on a model's hidden matrices, AdamW on the rest (`optimizer=muon`): as modded-nanogpt trains GPT-2 and
Moonshot trains Moonlight.

Muon (torch.optim.Muon) replaces each matrix's momentum by its nearest orthogonal matrix (a few Newton-Schulz
iterations) before applying it; it is meant for the matrices between the embedding and the output layer. The
embedding tables, the output layer, and every parameter that is not a matrix (biases, norms, convolution kernels)
keep AdamW. The two are one optimizer here, because everything downstream wants one: accelerate's wrapper, the
learning-rate schedule (which scales every group's rate alike), gradient clipping, the pickle-free checkpoint
(src/checkpointing/plain_state.py) and a resume. Its param_groups are the union of both optimizers' groups (each
naming its `algorithm`) and its state is the one dict both update, so state_dict/load_state_dict are torch's own.

Newton-Schulz is most of Muon's cost, and the ranks share it (WholeMatrixMuon), applying the bits one process
would compute: under DDP each orthogonalises every N-th matrix and broadcasts it; under FSDP2, where each matrix
is sharded by rows, each receives the rows of every N-th matrix, orthogonalises it whole and sends the rows back
(the memory beyond the shards: one matrix).
"""

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from src.errors import UsageError

log = logging.getLogger(__name__)


class WholeMatrixMuon(torch.optim.Muon):
    """torch's Muon, with its Newton-Schulz work shared among processes and each matrix orthogonalised whole.

    Replicated weights (one process, DDP): every rank holds the same averaged gradient, so rank r orthogonalises
    matrices r, r + N, r + 2N... of each group and broadcasts each result to the others (modded-nanogpt's way):
    a rank does 1/N of the work, and every rank applies the same bits it would have computed itself.
    Sharded weights (FSDP2 DTensors): each matrix's update is orthogonalised whole by one rank, which gathers its
    rows from the others and sends them their rows of the result (sharded_newton_schulz): again 1/N of the work
    a rank, and one process's bits. torch's Muon would run Newton-Schulz on the DTensors: the same maths, but
    its matrix products reduce bf16 partial sums across ranks at every iteration (measured: 5e-5 apart from one
    process after one step where DDP is bitwise) and communicate at each. The update is torch's
    _single_tensor_muon line for line, with the sharing around its Newton-Schulz."""

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
            if sharded and rows_sharded_on_one_mesh(params):
                orthogonal = sharded_newton_schulz(params, updates, settings)
            elif sharded:  # another layout (a 2-D mesh, columns sharded): each rank does all the work
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


def rows_sharded_on_one_mesh(params: list) -> bool:
    """FSDP2's default layout: every matrix's rows split among the ranks of one 1-D mesh."""
    return all(isinstance(p, DTensor) and p.device_mesh == params[0].device_mesh and p.device_mesh.ndim == 1
               and p.placements == (Shard(0),) for p in params)


def rows_of_each_rank(rows: int, processes: int) -> list[int]:
    """How many rows of a matrix each rank holds: torch.chunk's split, as FSDP2 shards (the last may hold none)."""
    held = [len(chunk) for chunk in torch.arange(rows).chunk(processes)]
    return held + [0] * (processes - len(held))


def sharded_newton_schulz(params: list, updates: list, settings: tuple) -> list:
    """Every update of rows-sharded matrices orthogonalised whole, the ranks sharing the work: in rounds of N
    matrices, rank j receives every rank's rows of the round's j-th update (one all-to-all), orthogonalises it, and
    sends each rank its rows of the result back (another). A rank holds one whole matrix at a time and does 1/N of
    the Newton-Schulz; the bits are those of one process (the whole update is the ranks' rows in order)."""
    mesh = params[0].device_mesh
    group, rank, processes = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    results = []
    for first in range(0, len(params), processes):
        matrices, shards = params[first:first + processes], [u.to_local() for u in updates[first:first + processes]]
        rows = [rows_of_each_rank(p.shape[0], processes) for p in matrices]  # rows[j][r]: rank r's of matrix j
        width = [p.shape[1] for p in matrices]
        if any(shard.shape[0] != rows[j][rank] for j, shard in enumerate(shards)):
            raise RuntimeError(f"optimizer=muon: a shard's rows are not torch.chunk's ({[s.shape for s in shards]})")
        owned = rank < len(matrices)
        from_each = [rows[rank][r] * width[rank] if owned else 0 for r in range(processes)]
        to_each = [rows[j][rank] * width[j] for j in range(len(matrices))] + [0] * (processes - len(matrices))
        whole = shards[0].new_empty(sum(from_each))
        dist.all_to_all_single(whole, torch.cat([shard.reshape(-1) for shard in shards]), from_each, to_each,
                               group=group)
        if owned:
            orthogonal = _zeropower_via_newtonschulz(whole.view(-1, width[rank]), *settings).contiguous()
        else:
            orthogonal = shards[0].new_empty(0, dtype=torch.bfloat16)
        mine = orthogonal.new_empty(sum(to_each))
        dist.all_to_all_single(mine, orthogonal.reshape(-1), to_each, from_each, group=group)
        for j, piece in enumerate(mine.split(to_each[:len(matrices)])):
            results.append(DTensor.from_local(piece.view(rows[j][rank], width[j]), mesh, (Shard(0),),
                                              run_check=False, shape=matrices[j].shape, stride=matrices[j].stride()))
    return results


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
        # A saved group keeps its settings (torch's rule), but which algorithm steps which tensors is this model's
        # split: a state that says otherwise (another split, an edited file) would step them with the other one.
        saved = [group.get("algorithm") for group in state_dict["param_groups"]]
        if saved != [group["algorithm"] for group in self.param_groups]:
            raise ValueError(f"the optimizer state's groups are stepped by {saved}; this model's split into Muon and "
                             f"AdamW is {[group['algorithm'] for group in self.param_groups]}")
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

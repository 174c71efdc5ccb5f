"""DPO's reference model: what the policy's log-probabilities are compared with (objective.reference; the choice is
explained in src/objectives/preference.py).

Each gives, for a batch of pairs (2B rows), the reference's answer log-probability per row, without gradients,
computed as the objective computes the policy's (its model_logps: objective.chunk_tokens too).
"""

import contextlib
import copy
import logging
from pathlib import Path
from typing import Mapping, Optional

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from src.checkpointing.training_state import sharded as is_sharded
from src.errors import UsageError
from src.loop.batches import split_batch
from src.objectives.preference import REFERENCE_FILE

log = logging.getLogger(__name__)


DESCRIBED = {"adapter": "the model with its LoRA adapter switched off (its base weights, no copy)",
             "copy": "a frozen copy of the starting weights on each process",
             "precomputed": "the starting weights' log-probabilities of every pair, computed before the first step"}


class Reference:
    @staticmethod
    def build(kind: str, accelerator: Accelerator, model: torch.nn.Module, data, run_dir: Path,
              checkpoint: Optional[Path], objective) -> "Reference":
        """The reference `kind` names (auto: the cheapest that is exact here), from the model as it starts: call it
        before a resume loads the checkpoint's weights."""
        inner = accelerator.unwrap_model(model)
        has_adapter = hasattr(inner, "disable_adapter") and hasattr(inner, "peft_config")
        sharded = is_sharded(accelerator)
        if kind == "auto":
            kind = "adapter" if has_adapter else "precomputed" if sharded else "copy"
        if accelerator.is_main_process:
            log.info("objective.reference=%s: %s", kind, DESCRIBED[kind])
        if kind == "adapter":
            if not has_adapter:
                raise UsageError("objective.reference=adapter needs a model with a LoRA adapter (model.peft): its "
                                 "base, with the adapter switched off, is the reference; use reference=copy or "
                                 "precomputed")
            return AdapterOff(objective)
        if kind == "copy":
            if sharded:
                raise UsageError("objective.reference=copy under FSDP would hold the whole model on every rank: use "
                                 "objective.reference=precomputed, or a LoRA adapter (reference=adapter)")
            return FrozenCopy(accelerator, inner, objective)
        return Precomputed.load_or_compute(accelerator, model, data, run_dir, checkpoint, objective)

    def __call__(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@contextlib.contextmanager
def evaluating(module: torch.nn.Module):
    """No dropout and no gradients, and the module's mode back afterwards."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


class AdapterOff(Reference):
    """The model itself with its adapter switched off: the base weights, with no copy (TRL's default with peft)."""

    def __init__(self, objective):
        self.objective = objective

    def __call__(self, model, inputs, targets):
        inner = getattr(model, "module", model)  # DDP's wrapper; FSDP2 and a bare model are the module itself
        with evaluating(model), inner.disable_adapter():
            return self.objective.model_logps(model, inputs, targets)[0]


class FrozenCopy(Reference):
    """A frozen copy of the starting weights on this process (TRL's ref_model)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, objective):
        self.accelerator, self.objective = accelerator, objective
        self.model = copy.deepcopy(model).requires_grad_(False).eval()

    def __call__(self, model, inputs, targets):
        with torch.no_grad(), self.accelerator.autocast():  # the policy's precision; the copy was not prepared
            return self.objective.model_logps(self.model, inputs, targets)[0]


def for_evaluation(accelerator: Accelerator, run_cfg, source: Path, objective) -> Reference:
    """eval.py's reference for a DPO run's model or checkpoint at `source`: the log-probabilities the run
    precomputed (in its run dir), else the run's starting model rebuilt from its config (model.pretrained; with an
    adapter, as a fresh run starts it: switched off, the base)."""
    from hydra.utils import instantiate
    from safetensors.torch import load_file

    for run_dir in (source.parent, source.parent.parent):
        if (run_dir / REFERENCE_FILE).is_file():
            return Precomputed(load_file(run_dir / REFERENCE_FILE)["reference_logps"], accelerator.device)
    if not run_cfg.model.get("pretrained"):
        raise UsageError(f"path={source}: objective=dpo's reference is the run's starting model, here a seeded "
                         f"random initialisation without model.pretrained, and {REFERENCE_FILE} is not in its run "
                         "dir; train with objective.reference=precomputed to evaluate such a run")
    starting = instantiate(run_cfg.model, _convert_="all").to(accelerator.device)
    return FrozenCopy(accelerator, starting, objective)


def pair_sets(data) -> list:
    """Every preference pair of the data, as the sets that number them (src/data/preference.py's Pairs): the
    training and validation pairs, or each source's of a mixture; whatever a run draws of them."""
    train = getattr(data.train, "dataset", data.train)  # trainer.limit_train_batches's first samples: all of them
    sets = list(getattr(train, "sources", [train])) + list(getattr(data.val, "datasets", [data.val]))
    return sorted(sets, key=lambda pairs: pairs.first_index)


class Precomputed(Reference):
    """The starting model's log-probabilities of every pair, chosen and rejected, computed once and kept with the
    run: a table of (pairs, 2) read by each batch's pair_index."""

    def __init__(self, table: torch.Tensor, device: torch.device):
        self.table = table.to(device)

    def __call__(self, model, inputs, targets):
        return self.table[inputs["pair_index"]].T.reshape(-1)  # chosen rows, then rejected rows

    @classmethod
    def load_or_compute(cls, accelerator: Accelerator, model, data, run_dir: Path, checkpoint: Optional[Path],
                        objective) -> "Precomputed":
        """A resume reads the table its run computed (beside the checkpoints: run_dir/checkpoints/step_N); a fresh
        run computes it, and rank 0 writes it into the run dir."""
        from safetensors.torch import load_file

        file = run_dir / REFERENCE_FILE
        sets = pair_sets(data)
        pairs = sets[-1].first_index + len(sets[-1])  # numbered one set after the other
        kept = checkpoint.parent.parent / REFERENCE_FILE if checkpoint is not None else None
        if kept is not None and kept.is_file():
            table = load_file(kept)["reference_logps"]
            if table.shape != (pairs, 2):
                raise UsageError(f"{kept}: reference log-probabilities of {table.shape[0]} pairs, but the data has "
                                 f"{pairs}: the run's data changed")
            log.info("objective.reference=precomputed: read %s", kept)
        else:
            if kept is not None:
                log.warning("objective.reference=precomputed: %s is missing, so the starting model's "
                            "log-probabilities are computed again (on this layout)", kept)
            table = cls.compute(accelerator, model, data, pairs, objective)
        if accelerator.is_main_process and not (file.is_file() and kept == file):
            from safetensors.torch import save_file

            partial = file.with_suffix(".partial")
            save_file({"reference_logps": table.contiguous()}, partial)
            partial.replace(file)  # atomic: a killed run leaves the old file or the new one
        accelerator.wait_for_everyone()
        return cls(table, accelerator.device)

    @staticmethod
    def compute(accelerator: Accelerator, model, data, pairs: int, objective) -> torch.Tensor:
        """One forward pass of the starting model over the training and validation pairs, split over the
        processes; every process ends with the whole table."""
        table = torch.full((pairs, 2), float("nan"))
        sets = pair_sets(data)
        for dataset in sets:
            loader = accelerator.prepare_data_loader(
                DataLoader(dataset, batch_size=data.eval_batch_size, collate_fn=data.collate_fn), device_placement=True)
            for batch in loader:
                inputs, targets = split_batch(batch, "labels")
                with evaluating(model):
                    logps = objective.model_logps(model, inputs, targets)[0]
                index, logps = accelerator.gather_for_metrics((inputs["pair_index"], logps.float().view(2, -1).T))
                table[index.cpu()] = logps.cpu()
        computed = int((~table.isnan().any(1)).sum())
        if computed != sum(len(s) for s in sets):
            raise RuntimeError(f"reference log-probabilities computed for {computed} pairs of "
                               f"{sum(len(s) for s in sets)}")
        log.info("objective.reference=precomputed: the starting model's log-probabilities of %d pairs", computed)
        return table

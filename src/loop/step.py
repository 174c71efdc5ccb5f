"""One optimizer step: the forward and backward passes of a window of micro-batches, clipping, the update.

The loss of the step is normalised by the targets of the whole global batch (src/loop/accumulation.py), so
the weights are the same however the global batch is split into processes and micro-batches. A step whose
loss or gradient is not finite is skipped or stops the run, decided on the device (src/faults/nonfinite.py):
the host waits for nothing here, only in `settle`, which the loop calls where it must know.
"""

import math
import warnings
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from omegaconf import DictConfig

from src.faults.nonfinite import NonFiniteGuard, plain
from src.loop.accumulation import global_target_count, loss_for_backward
from src.loop.batches import split_batch
from src.loop.forward import Forward
from src.objectives.base import Objective


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed loss over its counted targets (on the device)
    targets: torch.Tensor  # the global batch's count of targets, the same on every rank (on the device)
    tokens: torch.Tensor  # the global batch's tokens, as throughput counts them (Objective.throughput_count)
    grad_norm: torch.Tensor  # before clipping
    applied: bool  # False where the host already knows the step was skipped (trainer.nonfinite=skip)
    metrics: dict  # what else the objective reports of training: this rank's sums (src/objectives/base.py)


class TrainStep:
    def __init__(self, accelerator: Accelerator, model, optimizer, scheduler, ema, objective: Objective,
                 trainer: DictConfig, run_dir):
        self.accelerator, self.model, self.optimizer, self.scheduler, self.ema = (
            accelerator, model, optimizer, scheduler, ema)
        self.objective = objective
        self.forward = Forward(objective, trainer.compile, trainer.compile_mode)  # with trainer.compile, one graph
        self.guard = NonFiniteGuard(accelerator, optimizer, scheduler, ema, trainer.nonfinite,
                                    trainer.max_consecutive_skips, run_dir)
        self.max_grad_norm = trainer.max_grad_norm or math.inf  # inf: measure the norm for logging, clip nothing
        self.scale = None  # fp16: the GradScaler's scale after the last step (read at the first)
        self.reported: dict[str, float] = {}  # the objective's own training metrics as last logged (the summary's)

    def __call__(self, window: list, step: int) -> StepResult:
        """Optimizer step `step` + 1 over `window`, a list of gradient_accumulation_steps micro-batches."""
        accelerator, model, optimizer = self.accelerator, self.model, self.optimizer
        window = [split_batch(batch, self.objective.target_key) for batch in window]  # (inputs, targets) pairs
        self.objective.before_step(step)
        if step == 0:
            for inputs, micro_targets in window:
                self.objective.check_batch(inputs, micro_targets)
        window = self.objective.prepare_window(model, window)
        targets, tokens = global_target_count(accelerator, self.objective, [t for _, t in window])
        loss_sum, applied = 0.0, True
        if accelerator.scaler is not None and self.scale is None:
            self.scale = accelerator.scaler.get_scale()  # fp16: the scale the first step starts from
        for inputs, micro_targets in window:
            with accelerator.accumulate(model):
                micro_loss = self.forward.loss_sum(model, inputs, micro_targets)
                accelerator.backward(loss_for_backward(accelerator, micro_loss, targets))
                loss_sum += micro_loss.detach()
                if accelerator.sync_gradients:
                    grad_norm = plain(accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm))
                    applied = self.guard.step_is_finite(step + 1, loss_sum.sum(), grad_norm)
                if applied:
                    optimizer.step()  # a no-op until the accumulation window is complete
                optimizer.zero_grad(set_to_none=True)
        if applied and not self._scaler_skipped():
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update_parameters(accelerator.unwrap_model(model))
        return StepResult(loss_sum, targets, tokens, grad_norm, applied, self.objective.training_metrics())

    def pass_over(self) -> None:
        """A step of trainer.skip_steps (src/loop/skip_steps.py): its batches are dropped, the LR schedule takes
        its step. torch warns where a schedule steps before its optimizer ever has (a range from step 1): here no
        optimizer step is meant."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def _scaler_skipped(self) -> bool:
        """fp16: whether the GradScaler skipped the step just taken (its gradients overflowed). Not accelerate's
        optimizer_step_was_skipped, which misses every skip of a fused optimizer (AdamW's default on CUDA): the
        scaler then hands its found_inf to the optimizer's kernel, which skips inside. The scale falls exactly
        when the scaler skips (one host read per step, as GradScaler's unfused step makes itself)."""
        scaler = self.accelerator.scaler
        if scaler is None:
            return False
        before, self.scale = self.scale, scaler.get_scale()
        return self.scale < before

    def settle(self) -> None:
        """The host learns what the device decided since the last settle: stops at a non-finite step before
        anything of it is logged or saved, and counts skipped steps. Every rank calls it at the same steps."""
        self.guard.settle()

    def scalars(self, result: StepResult) -> dict[str, float]:
        """What a logging step reports of the step (every rank calls it: the loss is reduced over ranks)."""
        loss = (self.accelerator.reduce(result.loss_sum, "sum") / result.targets.clamp(min=1)).sum()
        samples = result.targets.reshape(-1)[0].clamp(min=1)  # an objective's first count: its samples (pairs)
        scalars = {}
        for name, value in result.metrics.items():  # a sum over the samples, or (a sum, its own count)
            total = self.accelerator.reduce(value, "sum")
            mean = total / samples if total.dim() == 0 else total[0] / total[1].clamp(min=1)
            scalars[f"train/{name}"] = mean.item()
        self.reported = dict(scalars)
        scalars |= {"train/loss": loss.item(), "train/lr": self.scheduler.get_last_lr()[0],
                   "train/grad_norm": result.grad_norm.item(), "train/skipped_steps": self.guard.skipped}
        if self.accelerator.scaler is not None:  # fp16: a falling scale marks the steps the GradScaler skipped
            scalars["train/loss_scale"] = self.accelerator.scaler.get_scale()
        return scalars

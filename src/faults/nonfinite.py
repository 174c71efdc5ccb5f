"""What happens when a step's loss or gradient norm is NaN or infinite: `trainer.nonfinite = error | skip`.

error: the run stops with every rank, naming the first bad step; no checkpoint, export or logged scalar ever
       holds it or anything after it, and the last good checkpoint stays the one to resume from.
skip:  the optimizer step is skipped on every rank (no update, no optimizer state, the LR schedule does not
       advance), counted in train/skipped_steps; more than trainer.max_consecutive_skips in a row stops the
       run as `error` does.

Neither waits for the device in a step that logs nothing. The verdict is computed on the device, and the
optimizer skips a bad step there itself: fused optimizers (AdamW's default on CUDA, `optimizer.fused=true`
elsewhere) take a `found_inf` tensor for exactly this, as a GradScaler uses it. The host reads the verdicts
only where it must know (`settle`): at a step that logs, evaluates or saves, and at the end, so at most
trainer.log_every steps later. Then error mode stops, and skip mode counts the skipped steps and moves the LR
schedule back by as many (the steps between a skip and the settle ran one schedule position ahead per skip).
A skip mode that cannot skip on the device (an optimizer without found_inf, an EMA, a schedule that is not a
closed-form LambdaLR) reads the verdict every step instead: one small sync, as before.

With fp16 a GradScaler is at work: an overflowing gradient is its business (it skips that step, and the LR
schedule with it, and lowers its scale), so only a non-finite loss counts here.

The ranks agree on the verdicts with one small all-reduce at `settle`.
"""

from typing import Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.optim.lr_scheduler import LambdaLR

from src.errors import NonFiniteStep

NO_STEP = float("inf")  # "no such step yet": the identity of the MIN that finds the first over ranks


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) result as the whole tensor it stands for; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class NonFiniteGuard:
    def __init__(self, accelerator: Accelerator, optimizer, scheduler, ema, mode: str, max_consecutive_skips: int,
                 run_dir):
        self.accelerator, self.mode, self.max_consecutive = accelerator, mode, max_consecutive_skips
        self.run_dir = run_dir
        # The torch objects inside accelerate's AcceleratedOptimizer and AcceleratedScheduler.
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.scheduler = getattr(scheduler, "scheduler", scheduler)
        self.scaler_skips_overflows = accelerator.scaler is not None
        # A fused optimizer skips a step whose found_inf is 1: weights, moments and step count stay as they were.
        self.device_skips = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False)
                                 and not self.scaler_skips_overflows)  # a GradScaler sets found_inf itself
        self.reads_every_step = mode == "skip" and not (
            self.device_skips and ema is None and type(self.scheduler) is LambdaLR)
        self.skipped, self.consecutive = 0, 0
        device = accelerator.device
        # On the device (float32: exact step numbers up to 2**24, and a dtype every device has): the first step
        # that stops the run (non-finite in error mode, one skip too many in skip mode) and its gradient norm,
        # the steps skipped since the last settle, and the skips in a row.
        self.stop_at = torch.full((2,), NO_STEP, device=device)
        self.skipped_since, self.in_a_row = torch.zeros((), device=device), torch.zeros((), device=device)

    def step_is_finite(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether train.py should apply optimizer step `step` (1-based); every rank calls it once per step.

        Without a read per step it always says yes: the optimizer then skips a bad step on the device, and
        `settle` reports it. With one, it is the verdict of all ranks, and raises NonFiniteStep to stop."""
        loss_sum, grad_norm = loss_sum.detach(), plain(grad_norm).detach()
        bad = ~torch.isfinite(loss_sum.float())
        if not self.scaler_skips_overflows:
            bad = bad | ~torch.isfinite(grad_norm.float())
        if self.reads_every_step:
            return self._read_now(step, bad, grad_norm)
        if self.mode == "skip" and self.accelerator.num_processes > 1:
            bad = bad.float()  # a loss is each rank's own: every rank must skip the same steps
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            bad = bad > 0
        if self.device_skips:
            self.optimizer.found_inf = bad.float()
        stops = bad
        if self.mode == "skip":
            self.skipped_since += bad
            self.in_a_row = torch.where(bad, self.in_a_row + 1, 0)
            stops = self.in_a_row > self.max_consecutive
        here = torch.stack([torch.full_like(self.stop_at[0], step), grad_norm.to(self.stop_at.dtype)])
        self.stop_at = torch.where(stops & (self.stop_at[0] == NO_STEP), here, self.stop_at)
        return True

    def _read_now(self, step: int, bad: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad.float(), "sum")
        if not bad.item():
            self.consecutive = 0
            return True
        if self.mode == "skip" and self.consecutive < self.max_consecutive:
            self.skipped += 1
            self.consecutive += 1
            return False
        raise self._error(step, grad_norm.item(), self.consecutive)

    def settle(self) -> None:
        """Where the host learns what the device decided since the last settle: raises NonFiniteStep at the
        first step that stops the run, counts the skipped steps and moves the LR schedule back by as many. Every
        rank calls it before anything is logged, evaluated or saved."""
        if self.reads_every_step:
            return
        stop_at = self.stop_at[0].clone()
        if self.accelerator.num_processes > 1:
            dist.all_reduce(stop_at, op=dist.ReduceOp.MIN)  # the earliest stopping step anywhere
        stop_at = stop_at.item()
        if stop_at != NO_STEP:
            # The norm is this rank's record of that step (a rank whose own loss was finite may have none).
            norm = self.stop_at[1].item() if self.stop_at[0].item() == stop_at else float("nan")
            raise self._error(int(stop_at), norm, self.max_consecutive if self.mode == "skip" else None)
        if self.mode == "skip":
            skipped = int(self.skipped_since.item())  # the same on every rank: their verdicts were all-reduced
            self.skipped_since.zero_()
            if skipped:
                self.skipped += skipped
                self.scheduler.last_epoch -= skipped + 1  # LambdaLR's rate is a function of its position
                self.scheduler.step()

    def _error(self, step: int, grad_norm: float, skipped_in_a_row: Optional[int] = None) -> NonFiniteStep:
        reason = (f" after {skipped_in_a_row} skipped steps in a row (trainer.max_consecutive_skips="
                  f"{self.max_consecutive})" if self.mode == "skip" else "")
        return NonFiniteStep(
            f"step {step}: the loss or the gradient norm is not finite (grad norm {grad_norm:.4g}){reason}. Nothing "
            f"of that step or after it was saved; the newest checkpoint in "
            f"{self.run_dir / 'checkpoints'} is intact (resume=auto continues from it). Usual causes: a learning "
            "rate too high (optimizer.lr), no gradient clipping (trainer.max_grad_norm), fp16 without enough "
            "range (use bf16). trainer.nonfinite=skip skips such steps instead."
        )

"""What happens when a step's loss or gradient norm is NaN or infinite: `trainer.nonfinite = error | skip`.

error: the run stops with every rank, and no checkpoint or export ever holds the bad step or anything after
       it: the last good checkpoint stays the one to resume from. The check costs no host sync: each step's
       verdict is kept on the device, and the host reads it only where it must know (`settle`): at a step
       that logs, evaluates or saves, and at the end, so at most trainer.log_every steps later. The steps in
       between may train on from a bad state; none of that is ever logged, evaluated or saved.
skip:  the optimizer step is skipped on every rank (no update, the LR schedule does not advance), counted in
       train/skipped_steps; more than trainer.max_consecutive_skips in a row stops the run as `error` does.
       Whether to apply a step must be known before the optimizer applies it and the schedule moves, so this
       mode reads the verdict on the host every step: one small sync, as a GradScaler makes.

With fp16 a GradScaler is at work: an overflowing gradient is its business (it skips that step, and the LR
schedule with it, and lowers its scale), so only a non-finite loss counts here.

The ranks agree on each verdict with one small all-reduce, which also carries their preemption votes
(src/preemption.py); in error mode that happens only at `settle`, so a stop signal is acted on there too.
"""

import torch
import torch.distributed as dist
from accelerate import Accelerator

from src.preemption import PreemptionWatch
from src.schema import UsageError

NO_STEP = float("inf")  # "no non-finite step yet", the identity of the MIN that finds the first


class NonFiniteStep(UsageError):
    """Printed as its message alone: the cause is the run's numbers, and the message says what to do."""


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) result as the whole tensor it stands for; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class NonFiniteGuard:
    def __init__(self, accelerator: Accelerator, mode: str, max_consecutive_skips: int, run_dir,
                 preemption: PreemptionWatch):
        self.accelerator, self.mode, self.max_consecutive = accelerator, mode, max_consecutive_skips
        self.run_dir, self.preemption = run_dir, preemption
        self.skipped, self.consecutive = 0, 0
        self.scaler_skips_overflows = accelerator.scaler is not None
        # error mode: the first non-finite step since the last settle and its gradient norm, kept on the device
        # (float32: exact step numbers up to 2**24, and a dtype every device has)
        self.first_bad = torch.full((2,), NO_STEP, device=accelerator.device, dtype=torch.float32)

    @property
    def reads_every_step(self) -> bool:
        return self.mode == "skip"

    def step_is_finite(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether to apply optimizer step `step` (1-based); every rank calls it once per optimizer step.

        error mode: always True, the verdict is recorded on the device for `settle`. skip mode: the verdict
        of all ranks, read now (it is also where they agree on preemption); raises NonFiniteStep to stop."""
        loss_sum, grad_norm = loss_sum.detach(), plain(grad_norm).detach()
        bad = ~torch.isfinite(loss_sum.float())
        if not self.scaler_skips_overflows:
            bad = bad | ~torch.isfinite(grad_norm.float())
        if not self.reads_every_step:
            here = torch.stack([torch.full_like(self.first_bad[0], step), grad_norm.to(self.first_bad.dtype)])
            self.first_bad = torch.where(bad & (self.first_bad[0] == NO_STEP), here, self.first_bad)
            return True
        flags = torch.stack([bad.float(), self.preemption.local_flag(bad.device)])
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, "sum")
        any_bad, stop_votes = flags.tolist()
        self.preemption.agree(stop_votes)
        if not any_bad:
            self.consecutive = 0
            return True
        if self.consecutive < self.max_consecutive:
            self.skipped += 1
            self.consecutive += 1
            return False
        raise self._error(step, grad_norm.item(), f" after {self.consecutive} skipped steps in a row "
                                                  f"(trainer.max_consecutive_skips={self.max_consecutive})")

    def settle(self) -> None:
        """Where the host learns what the device decided since the last settle (error mode; in skip mode it
        already knows): raises NonFiniteStep naming the first non-finite step, and has the ranks agree on
        preemption. Call it on every rank before anything is logged, evaluated or saved."""
        if self.reads_every_step:
            return
        # One MIN over ranks: the earliest bad step anywhere, and 0 for "a stop signal arrived" if any rank has one.
        flags = torch.cat([self.first_bad[:1], 1 - self.preemption.local_flag(self.first_bad.device)[None]])
        if self.accelerator.num_processes > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        first_bad, no_stop = flags.tolist()
        self.preemption.agree(1 - no_stop)
        if first_bad != NO_STEP:
            # The norm is this rank's record of that step (a rank whose own loss was finite may hold a finite one).
            norm = self.first_bad[1].item() if self.first_bad[0].item() == first_bad else float("nan")
            raise self._error(int(first_bad), norm)

    def _error(self, step: int, grad_norm: float, reason: str = "") -> NonFiniteStep:
        return NonFiniteStep(
            f"step {step}: the loss or the gradient norm is not finite (grad norm {grad_norm:.4g}){reason}. Nothing "
            f"of that step or after it was saved; the newest checkpoint in "
            f"{self.run_dir / 'checkpoints'} is intact (resume=auto continues from it). Usual causes: a learning "
            "rate too high (optimizer.lr), no gradient clipping (trainer.max_grad_norm), fp16 without enough "
            "range (use bf16). trainer.nonfinite=skip skips such steps instead."
        )

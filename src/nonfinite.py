"""What happens when a step's loss or gradient norm is NaN or infinite: `trainer.nonfinite = error | skip`.

error: every rank stops at that step, before the optimizer applies it, so no checkpoint or export ever holds
       the bad state and the last good checkpoint stays the one to resume from.
skip:  the optimizer step is skipped on every rank (no update, the LR schedule does not advance), counted in
       train/skipped_steps; more than trainer.max_consecutive_skips in a row stops the run as `error` does.

The check is made once per optimizer step, after clipping has computed the global gradient norm (the same on
every rank once DDP has averaged the gradients); each rank's loss is added with one small all-reduce, which
also carries the ranks' preemption votes (src/preemption.py). Deciding whether to apply a step needs its
answer on the host: one small sync per step, as a GradScaler makes.
"""

import torch
from accelerate import Accelerator

from src.preemption import PreemptionWatch
from src.schema import UsageError


class NonFiniteStep(UsageError):
    """Printed as its message alone: the cause is the run's numbers, and the message says what to do."""


class NonFiniteGuard:
    def __init__(self, accelerator: Accelerator, mode: str, max_consecutive_skips: int, run_dir,
                 preemption: PreemptionWatch):
        self.accelerator, self.mode, self.max_consecutive = accelerator, mode, max_consecutive_skips
        self.run_dir, self.preemption = run_dir, preemption
        self.skipped, self.consecutive = 0, 0

    def step_is_finite(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether to apply optimizer step `step` (1-based); raises NonFiniteStep to stop the run.
        Every rank calls it once per optimizer step: it is also where the ranks agree on preemption."""
        bad = (~torch.isfinite(loss_sum.detach().float())).float() + (~torch.isfinite(grad_norm.float())).float()
        flags = torch.stack([bad, self.preemption.local_flag(bad.device)])
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, "sum")
        bad, stop_votes = flags.tolist()
        self.preemption.agree(stop_votes)
        if not bad:
            self.consecutive = 0
            return True
        what = f"step {step}: the loss or the gradient norm is not finite (grad norm {grad_norm.item():.4g})"
        if self.mode == "skip" and self.consecutive < self.max_consecutive:
            self.skipped += 1
            self.consecutive += 1
            return False
        reason = (f" after {self.consecutive} skipped steps in a row (trainer.max_consecutive_skips="
                  f"{self.max_consecutive})" if self.mode == "skip" else "")
        raise NonFiniteStep(
            f"{what}{reason}. The step was not applied and nothing of it was saved; the newest checkpoint in "
            f"{self.run_dir / 'checkpoints'} is intact (resume=auto continues from it). Usual causes: a learning "
            "rate too high (optimizer.lr), no gradient clipping (trainer.max_grad_norm), fp16 without enough "
            "range (use bf16). trainer.nonfinite=skip skips such steps instead."
        )

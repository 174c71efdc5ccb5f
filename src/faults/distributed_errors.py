"""torch's distributed failures that are a user's to fix, said in this template's words: what is wrong, and
the key that changes it, instead of a traceback that names torch's keywords."""

import contextlib
import re
from typing import Optional

import torch

from src.errors import DistributedFailure, LaunchError, UsageError
from src.faults.hang_watch import silent_ranks
from src.schema.trainer import TrainerConfig


def unused_parameters(error: RuntimeError, model: torch.nn.Module) -> Optional[UsageError]:
    """DDP's "Expected to have finished reduction in the prior iteration": parameters that got no gradient."""
    message = str(error)
    if "Expected to have finished reduction in the prior iteration" not in message:
        return None
    module = getattr(model, "module", model)  # DDP's parameter indices count the wrapped model's trainable ones
    trainable = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
    found = re.search(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)", message)
    names = [trainable[int(i)] for i in found.group(2).split() if int(i) < len(trainable)] if found else []
    which = (f" (rank {found.group(1)}): {', '.join(names)}" if names else
             "; run with TORCH_DISTRIBUTED_DEBUG=DETAIL for their names")
    return UsageError(
        f"Under DDP every trainable parameter must get a gradient in every optimizer step; these got none{which}. "
        "If the model skips them by design (a branch some steps do not take), set "
        "trainer.ddp_find_unused_parameters=true (one more pass over the graph per step); if they should not train, "
        "freeze them (requires_grad=False) or remove them."
    )


def port_in_use(error: Exception, port: Optional[str], host: Optional[str]) -> Optional[LaunchError]:
    """A main port another process holds, met where this process is the one that listens (env:// launches)."""
    if "EADDRINUSE" not in str(error):
        return None
    return LaunchError(
        f"the main port {port} on {host} is already in use, by another job or process: choose a free one "
        "(MASTER_PORT=... for srun or other env:// launches, --main_process_port for accelerate launch, "
        "--master_port for torchrun, MAIN_PORT for slurm/train_multi_node.sbatch)."
    )


# What gloo and NCCL say when a collective ends without every rank: a timeout, or a peer whose process is gone.
LOST_PEER_SIGNS = ("Timed out waiting", "timed out", "Connection closed by peer", "Connection reset by peer",
                   "Watchdog caught collective operation timeout", "NCCL communicator was aborted")


@contextlib.contextmanager
def lost_ranks_in_our_words(timeout_s: Optional[float], hang_report_s: Optional[float] = None):
    """A collective that ended without every rank: which ranks stopped answering and what each last finished,
    instead of gloo's or NCCL's error and a traceback of the loop."""
    try:
        yield
    except RuntimeError as error:
        if not any(sign in str(error) for sign in LOST_PEER_SIGNS):
            raise
        lost = (silent_ranks(hang_report_s or TrainerConfig.hang_report_s)
                or "the rank that logged no HANG? report above is the one")
        if "time" in str(error).lower():  # "timed out", "timeout": the peer may still be alive, but stuck
            why = (f"another rank stopped answering, and trainer.dist_timeout_s="
                   f"{timeout_s or TrainerConfig.dist_timeout_s} s passed")
        else:  # the peer's connection closed: its process ended
            why = "another rank's process ended (its own error, if it had one, is above)"
        raise DistributedFailure(
            f"A collective operation ended without every rank ({str(error).strip().splitlines()[0]}): {why}. "
            f"Not answering: {lost}. The newest complete checkpoint resumes with resume=auto once every rank runs "
            "again."
        ) from None

"""train.py under accelerate's own FSDP2 plugin on CPU processes over gloo, for tests of the FSDP path without GPUs.

accelerate turns `distributed_type: FSDP` (config/accelerate/fsdp.yaml) into FSDP only on an accelerator; on
CPU processes (train.py passes cpu=True there) it keeps MULTI_CPU and wraps the model in DDP. Everything the
plugin does runs on CPU and gloo with this torch, though: fully_shard, its sharded checkpoints through
torch.distributed.checkpoint and their resharding on load, the full state dict for the export. So this wrapper
lifts only that one device check and then runs train.py unchanged, as `accelerate launch --config_file
config/accelerate/fsdp.yaml --num_processes N tests/fsdp_on_cpu.py KEY=VALUE ...` (conftest's launcher="fsdp").
"""

import runpy
import sys
from pathlib import Path

import accelerate.state
from accelerate.utils import DistributedType

REPO = Path(__file__).resolve().parents[1]
set_up_state = accelerate.state.AcceleratorState.__init__


def as_on_a_gpu(state, *args, fsdp_plugin=None, **kwargs):
    """What AcceleratorState does with an FSDP plugin on GPUs (state.py: MULTI_GPU -> FSDP), on CPU processes.
    Every later AcceleratorState() copies the process state (MULTI_CPU) back in, so it is kept each time."""
    set_up_state(state, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and state.distributed_type == DistributedType.MULTI_CPU:
        if state.mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(state.mixed_precision)
        state._shared_state["fsdp_plugin_on_cpu"] = fsdp_plugin
    plugin = state._shared_state.get("fsdp_plugin_on_cpu")
    if plugin is not None:
        state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin


accelerate.state.AcceleratorState.__init__ = as_on_a_gpu
sys.path.insert(0, str(REPO))
runpy.run_path(str(REPO / "train.py"), run_name="__main__")

"""How much memory the export of FSDP2-sharded weights takes on each rank, beyond what the process held before it
(torchrun --nproc_per_node 2, CPU/gloo; weights sharded with torch's fully_shard, as accelerate's plugin shards
them). Each rank's high-water mark of resident memory is reset (/proc/self/clear_refs) before an export and read
after it; both paths are measured on the same model: the streamed one (export_model) and the gathered one
(a whole state dict on rank 0), which shows what the measure sees of one whole copy. `lora` adapts a transformers
GPT-2 with peft first, so that the export also merges the adapter. Rank 0 prints one JSON line; any failure raises.

    torchrun --nproc_per_node 2 tests/fsdp_export_memory.py gpt|lora
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.checkpointing.export import export_gathered, export_model  # noqa: E402


def resident_peak_after_reset() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current size
    return resident("VmRSS")


def resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


kind = sys.argv[1]
# Enough layers that what an export costs whatever the model's size (gather buffers, the allocator: 0.03-0.05 GiB
# measured on each rank) stays far below half the model: at 8 layers (0.099 GiB) it came within 10 % of it.
LAYERS = 24
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
if kind == "gpt":
    from src.models.gpt import GPT

    config = OmegaConf.create({"_target_": "src.models.gpt.GPT", "vocab_size": 256, "block_size": 64, "n_layer": LAYERS,
                               "n_head": 8, "n_embd": 512})
    model = GPT(**{k: v for k, v in config.items() if k != "_target_"})
    layers = model.blocks
else:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = OmegaConf.create({"_target_": "src.models.hf_causal_lm.HFCausalLM"})
    model = get_peft_model(GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=512, n_head=8, vocab_size=1000,
                                                      n_positions=64)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"]))
    for name, parameter in model.named_parameters():  # a trained adapter: B is zero at its start
        if "lora_B" in name:
            parameter.data.normal_(0, 0.02)
    layers = model.get_base_model().transformer.h
whole_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
mesh = init_device_mesh("cpu", (accelerator.num_processes,))
for layer in layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

found = {}
with tempfile.TemporaryDirectory() as tmp:
    folder = Path(broadcast_object_list([tmp])[0])
    for path, export in (("streamed", lambda: export_model(accelerator, model, config, folder / "streamed")),
                         ("gathered", lambda: export_gathered(accelerator, model, model, folder / "gathered"))):
        if path == "gathered" and accelerator.is_main_process:
            (folder / "gathered").mkdir()
        accelerator.wait_for_everyone()
        before = resident_peak_after_reset()
        started = time.perf_counter()
        export()
        seconds = time.perf_counter() - started
        found[path] = gather_object([{"beyond_gib": (resident("VmHWM") - before) / 2**30, "seconds": seconds}])
    if accelerator.is_main_process:
        from safetensors.torch import load_file

        streamed, gathered = (load_file(folder / p / "model.safetensors") for p in ("streamed", "gathered"))
        same = streamed.keys() == gathered.keys() and all(torch.equal(streamed[k], gathered[k]) for k in streamed)
        print(json.dumps({"whole_gib": whole_bytes / 2**30, "largest_tensor_gib": largest / 2**30,
                          "same_files": same, **found}), flush=True)
    accelerator.wait_for_everyone()
accelerator.end_training()

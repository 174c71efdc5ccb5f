"""Our code on FSDP2-sharded weights, on a real process group (torchrun --nproc_per_node 2, CPU/gloo): accelerate
runs its FSDP plugin only on GPUs, so the model is sharded here with torch's own fully_shard, as the plugin
does. Clipping and the non-finite check on a DTensor norm, a distillation teacher's and GRPO's generation's
gathering, and the export of sharded, tied weights. Rank 0
prints one JSON line of what it found; any failure raises."""

import json
import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.checkpointing.export import export_model, load_exported_model
from src.errors import NonFiniteStep
from src.faults.nonfinite import NonFiniteGuard, plain
from src.loop.forward import Forward
from src.models.gpt import GPT  # noqa: E402
from src.objectives.classification import CrossEntropy

accelerator = Accelerator(cpu=True)
config = OmegaConf.create({"_target_": "src.models.gpt.GPT", "vocab_size": 50, "block_size": 16, "n_layer": 2,
                           "n_head": 2, "n_embd": 32})
torch.manual_seed(0)
whole = GPT(**{k: v for k, v in config.items() if k != "_target_"})
sharded = GPT(**{k: v for k, v in config.items() if k != "_target_"})
sharded.load_state_dict(whole.state_dict())
mesh = init_device_mesh("cpu", (accelerator.num_processes,))
for block in sharded.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(sharded, mesh=mesh)
assert any(hasattr(p, "full_tensor") for p in sharded.parameters())  # really sharded

forward = Forward(CrossEntropy(), compile=False)
x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))  # the same batch on every rank
forward.loss_sum(whole, x, y).backward()
whole_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.5)
loss = forward.loss_sum(sharded, x, y)
loss.backward()
norm = plain(accelerator.clip_grad_norm_(sharded.parameters(), 0.5))
assert not hasattr(norm, "full_tensor") and torch.allclose(norm, whole_norm), (norm, whole_norm)
clipped = {name: plain(p.grad) for name, p in sharded.named_parameters()}
assert all(torch.allclose(clipped[name], p.grad, atol=1e-6) for name, p in whole.named_parameters())

# A distillation teacher sharded as the student: its weights sharded again after each of its forwards (FSDP2 keeps
# the root module's own gathered for a backward, which a frozen teacher never takes), and the terms computed in chunks
# from its output layer gathered again for the student's step: the whole logits' terms.
from src.objectives.distillation import Distillation  # noqa: E402

teacher = GPT(**{k: v for k, v in config.items() if k != "_target_"})
for block in teacher.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(teacher.requires_grad_(False).eval(), mesh=mesh)
teacher_sharded, teacher_losses = [], []
for chunk_tokens in (None, 5):
    objective = Distillation(teacher="in memory", chunk_tokens=chunk_tokens)
    objective.teacher, objective.accelerator, objective._sums = teacher, accelerator, torch.zeros(2)
    inputs = objective.with_reference(sharded, x, y)
    teacher_sharded.append(all(hasattr(p, "full_tensor") for p in teacher.parameters()))
    with Forward(objective, compile=False)._output_layer_computes(sharded, inputs, y):
        teacher_losses.append(Forward(objective, compile=False)._loss_sum(sharded, inputs, y).item())
assert abs(teacher_losses[0] - teacher_losses[1]) < 1e-5 * abs(teacher_losses[0]), teacher_losses

# GRPO's generation on sharded weights: with gather_for_generation every block is gathered by the first pass and kept
# so until generation ends (a rollout's all-gathers do not grow with its tokens), then sharded again, and resharded
# after each forward as before; the completions are those that passes gathering every time write.
from src.data.tokenizer import Codec  # noqa: E402
from src.objectives.grpo import GRPO  # noqa: E402


class Prompts:
    codec, block_size = Codec("byte"), 32
    rows = [{"prompt": "write a:", "letter": "a"}, {"prompt": "now write b:", "letter": "b"}]


torch.manual_seed(0)
policy = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
for block in policy.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(policy, mesh=mesh)
gathers, all_gather_single = [], torch.distributed.all_gather_single


def counted_all_gather(*args, **kwargs):  # FSDP2's all-gather of a module's weights, counted, then made
    gathers[-1] += 1
    return all_gather_single(*args, **kwargs)


torch.distributed.all_gather_single = counted_all_gather
prompt_ids = [torch.tensor(list(row["prompt"].encode())) for row in Prompts.rows]
inputs = {"input_ids": torch.nn.utils.rnn.pad_sequence(prompt_ids, batch_first=True),
          "prompt_tokens": torch.tensor([len(ids) for ids in prompt_ids])}
grpo_gathers, grpo_completions = {}, {}
for gather in (True, False):
    for tokens in (4, 12):
        objective = GRPO(reward="tests.grpo_rewards.letter_share", num_generations=2, max_completion_tokens=tokens,
                         gather_for_generation=gather)
        objective.start(accelerator, policy, Prompts(), None, None)
        objective.sharded, objective.passes_gather = True, not gather  # what start() finds under accelerate's FSDP
        gathers.append(0)
        rollout = objective.rollout(policy, inputs, torch.tensor([0, 1]), 0, 2)
        grpo_gathers[f"{gather} {tokens}"] = gathers[-1]
        grpo_completions[f"{gather} {tokens}"] = rollout["input_ids"].tolist()
        for after in (1, 2):  # the blocks sharded again by the rollout's end, and after each forward since
            gathers.append(0)
            with torch.no_grad():
                policy(inputs["input_ids"])
            grpo_gathers[f"{gather} {tokens} forward {after}"] = gathers[-1]
torch.distributed.all_gather_single = all_gather_single

with tempfile.TemporaryDirectory() as tmp:
    optimizer = torch.optim.AdamW(sharded.parameters(), fused=True)  # found_inf: a bad step changes nothing
    before = {name: plain(p).clone() for name, p in sharded.named_parameters()}
    guard = NonFiniteGuard(accelerator, optimizer, None, None, "error", 3, Path(tmp))
    assert guard.step_is_finite(1, loss, norm)
    guard.settle()  # a finite step: nothing to report
    nan_loss = forward.loss_sum(sharded, x, y) * float("nan")
    nan_loss.backward()
    guard.step_is_finite(2, nan_loss, plain(accelerator.clip_grad_norm_(sharded.parameters(), 0.5)))
    optimizer.step()
    assert all(torch.equal(plain(p), before[name]) for name, p in sharded.named_parameters())
    try:
        guard.settle()
        raise AssertionError("a NaN step on sharded weights was not reported")
    except NonFiniteStep as error:
        assert str(error).startswith("step 2:") and "not finite" in str(error), error

    export_dir = Path(broadcast_object_list([tmp])[0]) / "model"  # rank 0's directory, on every rank
    export_model(accelerator, sharded, config, export_dir)
    if accelerator.is_main_process:
        loaded = load_exported_model(export_dir)
        tied = loaded.lm_head.weight is loaded.tok_emb.weight
        same = all(torch.equal(loaded.state_dict()[k], v) for k, v in whole.state_dict().items())
        print(json.dumps({"tied": tied, "weights_equal": same, "norm": norm.item(),
                          "teacher_sharded_after_its_forward": teacher_sharded, "grpo_gathers": grpo_gathers,
                          "grpo_completions": grpo_completions}), flush=True)
    accelerator.wait_for_everyone()
accelerator.end_training()

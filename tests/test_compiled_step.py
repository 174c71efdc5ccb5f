"""trainer.compile compiles a micro-step's forward and loss as one graph, and evaluation once for all batch sizes."""

import torch
from torch._dynamo.utils import counters

from src.loop.forward import Forward
from src.models.gpt import GPT
from src.objectives.classification import CausalLM, CrossEntropy


class MappingOutput(GPT):
    """A Hugging Face-style model: keyword inputs, logits in a mapping."""

    def forward(self, input_ids, attention_mask=None):
        return {"logits": super().forward(input_ids, attention_mask)}


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def test_the_compiled_step_is_one_graph_with_the_eager_loss_and_gradients_for_each_batch_and_output_form():
    torch.manual_seed(0)
    cases = [(GPT, CrossEntropy(), lambda x: x, False, "default"),
             (MappingOutput, CausalLM(), lambda x: {"input_ids": x}, True, "max-autotune-no-cudagraphs")]
    for model_class, objective, as_inputs, checkpointing, mode in cases:  # the second: activation checkpointing too
        model = model_class(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32,
                            gradient_checkpointing=checkpointing)
        x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
        y = x if objective.shifts_targets else y
        eager = Forward(objective, compile=False).loss_sum(model, as_inputs(x), y)
        eager.backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch._dynamo.reset()
        before = graphs_compiled()
        compiled = Forward(objective, compile=True, mode=mode).loss_sum(model, as_inputs(x), y)
        assert graphs_compiled() - before == 1  # the model and the loss in one graph: no graph break
        compiled.backward()
        assert torch.allclose(compiled, eager, rtol=1e-5)
        assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), eager_grads))
        assert not any("_orig_mod" in name for name in model.state_dict())


def test_compile_mode_reaches_the_training_step_and_leaves_evaluation_at_the_default():
    def autotunes(compiled) -> bool:
        return compiled.get_compiler_config()["max_autotune"]

    tuned, default = Forward(CrossEntropy(), True, "max-autotune-no-cudagraphs"), Forward(CrossEntropy(), True)
    assert autotunes(tuned._train_step) and not autotunes(default._train_step)
    assert not autotunes(tuned._compiled_metrics)


def test_compiled_evaluation_compiles_once_for_every_batch_size():
    torch.manual_seed(0)
    model = GPT(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32).eval()
    forward = Forward(CrossEntropy(), compile=True)
    torch._dynamo.reset()
    before = graphs_compiled()
    with torch.no_grad():
        for batch in (8, 8, 5, 3):  # full batches, a last partial one, another evaluation batch size
            x, y = torch.randint(0, 50, (batch, 16)), torch.randint(0, 50, (batch, 16))
            compiled = forward.metrics(model, x, y)
            eager = Forward(CrossEntropy(), compile=False).metrics(model, x, y)
            assert all(torch.allclose(compiled[k][0], eager[k][0], atol=1e-5) for k in eager)
    assert graphs_compiled() - before == 1

"""What the model's state costs each rank, stated before the first step, and what would fit where it cannot."""

import re

import torch

from src.launch.memory import model_state, what_would_fit
from tests.conftest import named


def tied_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(100, 10), torch.nn.Linear(10, 100, bias=False))
    model[1].weight = model[0].weight  # tied: counted once, as the state holds it once
    return model


def test_weights_gradients_and_adams_two_moments_are_counted_once_per_tied_weight_and_sharded():
    whole = model_state(tied_model(), "src.optim.optimizers.adamw", shards=1)
    assert (whole.parameters, whole.weights, whole.gradients, whole.optimizer) == (1000, 4000, 4000, 8000)
    sharded = model_state(tied_model(), "torch.optim.AdamW", shards=3)
    assert (sharded.weights, sharded.gradients, sharded.optimizer) == (1334, 1334, 2667)  # rounded up
    assert "sharded over 3 ranks" in sharded.describe() and "a whole copy on each rank" in whole.describe()


def test_frozen_weights_have_no_gradients_nor_optimizer_state_and_an_unknown_optimizer_is_said_so():
    model = tied_model()
    model.append(torch.nn.Linear(100, 1))  # 101 trainable parameters
    model[0].requires_grad_(False)
    sgd = model_state(model, "src.optim.optimizers.sgd", shards=1, momentum=0.9)
    assert (sgd.weights, sgd.gradients, sgd.optimizer) == (4404, 404, 404)
    assert model_state(model, "torch.optim.SGD", shards=1).optimizer == 0  # no momentum: no state
    unknown = model_state(model, "my.optim.Lion2", shards=1)
    assert unknown.optimizer is None and "optimizer state unknown" in unknown.describe()


def test_a_state_larger_than_a_ranks_memory_names_the_layouts_that_would_fit():
    state = model_state(tied_model(), "torch.optim.AdamW", shards=1)  # 16,000 bytes per rank
    ddp = what_would_fit(state, available=10_000, world_size=2, precision="no")
    named(ddp, "15.6 KiB", "9.8 KiB", "FSDP2 (config/accelerate/fsdp.yaml)", "7.8 KiB")  # needed, had, a fit
    assert "trainer.mixed_precision=bf16" in ddp and "activation checkpointing" in ddp
    fsdp = what_would_fit(model_state(tied_model(), "torch.optim.AdamW", shards=2), available=3_000, world_size=2,
                          precision="bf16")
    assert re.search(r"more ranks: .*6 or more.* 2\.6 KiB", fsdp), fsdp  # 16,000 / 3,000
    assert "bf16" not in fsdp.split("What would fit")[1]  # already chosen

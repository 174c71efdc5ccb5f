"""A micro-step's forward pass and loss as one function: with trainer.compile, one compiled graph.

Compiling the model alone leaves the loss outside the compiler's reach: the logits are written out in fp32
(accelerate's autocast wrapper and the objective both upcast them; for a GPT-2-sized vocabulary 2.4 GB per
micro-step) and read back by an unfused softmax. Compiled together with the objective, the upcast and the
log-softmax fuse into the kernels that consume the logits (measured on an H100 for GPT-2-124M, 12 x 5
micro-steps: 177 -> 142 ms per step in train.py; in a bare loop, peak memory 12.9 -> 7.2 GiB). It works for
any objective, batch form and model output (src/loop/batches.py), because the compiler traces exactly the code the
eager path runs.

The model is an argument, not compiled in place, so parameter names in checkpoints and exports never carry
the compiler's `_orig_mod.` prefix. Under DDP the compiler splits the model's graph at the gradient buckets
(its DDPOptimizer), so communication still overlaps the backward pass.

Evaluation compiles its own function (no backward, no dropout) once for every batch size: the batch dimension
is marked dynamic, so a last partial batch or data.eval_batch_size costs no recompilation. trainer.compile_mode
applies to the training step only: evaluation runs a few batches per evaluation, so kernel autotuning would
cost more compile time than it could win back.
"""

import contextlib
from typing import Any, Mapping

import torch

from src.faults.distributed_errors import unused_parameters
from src.objectives.base import Objective
from src.objectives.chunked import check_the_model_keeps_its_logits, output_layer_loss
from src.objectives.classification import CrossEntropy


class Forward:
    def __init__(self, objective: Objective, compile: bool, mode: str = "default"):
        self.objective = objective
        # objective.chunk_tokens of cross_entropy and causal_lm: the model's output layer computes the loss sum
        # (src/objectives/chunked.py); preference objectives have it compute their log-probabilities themselves.
        self.chunked = isinstance(objective, CrossEntropy) and objective.chunk_tokens is not None
        self._chunking_unchecked = getattr(objective, "chunk_tokens", None) is not None
        self._train_step = torch.compile(self._loss_sum, mode=mode) if compile else self._loss_sum
        self._compiled_metrics = torch.compile(self._metrics) if compile else None

    def loss_sum(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The training loss summed over this micro-batch's counted targets (see src/objectives/base.py)."""
        if self._chunking_unchecked:
            check_the_model_keeps_its_logits(model, inputs, targets, self.objective)
            self._chunking_unchecked = False
        inputs = self.objective.with_reference(model, inputs, targets)  # a reference model's pass: not compiled
        try:
            with self._output_layer_computes(model, inputs, targets):
                return self._train_step(model, inputs, targets)
        except RuntimeError as error:  # DDP reports parameters without gradients here, at the next forward
            raise unused_parameters(error, model) or error

    def _loss_sum(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if not self.chunked:
            return self.objective.model_loss_sum(model, inputs, targets)
        return self.objective.loss_sum_from_output_layer(model, inputs, targets)

    def _metrics(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> dict:
        if self.chunked:  # per-token scores (loss, likeliest is the target) from the output layer, chunk by chunk
            return self.objective.metrics_from_output_layer(model, inputs, targets)
        return self.objective.model_metrics(model, inputs, targets)

    def metrics(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> dict:
        """The objective's per-sample metrics of one evaluation batch."""
        if self._chunking_unchecked:  # an evaluation before the first step (trainer.eval_on_start)
            check_the_model_keeps_its_logits(model, inputs, targets, self.objective)
            self._chunking_unchecked = False
        inputs = self.objective.with_reference(model, inputs, targets)
        with self._output_layer_computes(model, inputs, targets, per_token=True):
            if self._compiled_metrics is None:
                return self._metrics(model, inputs, targets)
            for tensor in (*(inputs.values() if isinstance(inputs, Mapping) else [inputs]), targets):
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
            return self._compiled_metrics(model, inputs, targets)

    def _output_layer_computes(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor,
                               per_token: bool = False) -> contextlib.AbstractContextManager:
        if not self.chunked:
            return contextlib.nullcontext()
        return output_layer_loss(model, self.objective, self.objective.output_layer_targets(inputs, targets),
                                 per_token)

"""User code as a user would add it (a model, an objective), for the tests that follow the open contract."""

import functools
import json
import os
import time

import torch

from src.data.jsonl import JsonlData
from src.data.text import TextData
from src.models.gpt import GPT
from src.objectives.classification import CausalLM


class AutocastRecorder(GPT):
    """The GPT, writing on its first training forward whether autocast is on and in which dtype."""

    def forward(self, input_ids, attention_mask=None):
        path = os.environ.get("AUTOCAST_RECORD")
        if path and self.training and not os.path.exists(path):
            with open(path, "w") as f:
                json.dump({"enabled": torch.is_autocast_enabled("cpu"),
                           "dtype": str(torch.get_autocast_dtype("cpu"))}, f)
        return super().forward(input_ids, attention_mask)


class MeanPerMicroBatch(CausalLM):
    """The normalisation this template does NOT do: each micro-batch's mean, as if it were the step's."""

    def count(self, targets):
        return torch.ones((), device=targets.device)

    def loss_sum(self, logits, targets):
        return super().loss_sum(logits, targets) / super().count(targets).clamp(min=1)


class UndeclaredJsonl(JsonlData):
    """Hugging Face-style labels (= input_ids) from a dataset that does not say so."""

    targets_are_inputs = False


class Stream(torch.utils.data.IterableDataset):
    """A dataset's samples over and over, as an iterable without a length (a user's streamed data)."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        for i in range(10**9):
            yield self.samples[i % len(self.samples)]


class StreamedText(TextData):
    """data=text whose training set has no length."""

    @functools.wraps(TextData.__init__)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train = Stream(self.train)


class OutOfMemoryAbove(GPT):
    """The GPT, failing as a GPU does when a batch holds more than `max_batch` samples."""

    def __init__(self, max_batch: int = 2, **gpt):
        super().__init__(**gpt)
        self.max_batch = max_batch

    def forward(self, input_ids, attention_mask=None):
        if len(input_ids) > self.max_batch:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried a batch of {len(input_ids)}")
        return super().forward(input_ids, attention_mask)


class AlteredOnCalls(GPT):
    """The GPT, its logits passed through `alter` on the training forward calls in `altered_calls` (1-based)."""

    altered_calls: set = set()
    calls = 0

    def forward(self, input_ids, attention_mask=None):
        logits = super().forward(input_ids, attention_mask)
        if self.training:
            self.calls += 1
            if self.calls in self.altered_calls:
                return self.alter(logits)
        return logits


class NaNOnCalls(AlteredOnCalls):
    """NaN logits on the training forward calls listed."""

    def __init__(self, nan_calls: tuple = (), **gpt):
        super().__init__(**gpt)
        self.altered_calls = set(nan_calls)

    def alter(self, logits):
        return logits * float("nan")


class ScaledGradient(torch.autograd.Function):
    """The identity forward; its backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class OverflowOnCalls(AlteredOnCalls):
    """A backward that overflows fp16 on the training forward calls listed: the loss is the GPT's own, finite,
    but the logits' gradient is a million times larger, so a GradScaler skips those steps."""

    def __init__(self, overflow_calls: tuple = (), **gpt):
        super().__init__(**gpt)
        self.altered_calls = set(overflow_calls)

    def alter(self, logits):
        return ScaledGradient.apply(logits, 1e6)


class NaNWhenEvaluating(GPT):
    """The GPT, training normally and returning NaN logits in evaluation."""

    def forward(self, input_ids, attention_mask=None):
        logits = super().forward(input_ids, attention_mask)
        return logits if self.training else logits * float("nan")


class WithUnusedHead(GPT):
    """The GPT with a trainable layer its forward never uses: under DDP it gets no gradient."""

    def __init__(self, **gpt):
        super().__init__(**gpt)
        self.unused_head = torch.nn.Linear(4, 4)


class SaysHowItWasBuilt(GPT):
    """The GPT, printing on each rank whether its parameters were made with values (not on the meta device)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        print(f"rank {os.environ.get('RANK', '0')} built with values: {not self.lm_head.weight.is_meta}", flush=True)


class SlowToSample(GPT):
    """The GPT, taking `sample_seconds` longer for each text it samples (rank 0 alone samples)."""

    def __init__(self, sample_seconds: float = 0.0, **gpt):
        super().__init__(**gpt)
        self.sample_seconds = sample_seconds

    def generate(self, *args, **kwargs):
        time.sleep(self.sample_seconds)
        return super().generate(*args, **kwargs)

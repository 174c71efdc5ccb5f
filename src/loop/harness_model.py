"""The model being trained, as lm-evaluation-harness sees a language model (imported only with trainer.eval_tasks:
the harness is an optional extra).

Not the harness's HFLM: that one loads or wraps a transformers model on one device, where this scores whatever
the run trains (the template's GPT or a transformers model, with or without LoRA, DDP or FSDP) through the
run's own tokenizer, and speaks to the harness's evaluator through the run's Accelerator: the evaluator gives
each rank its share of the documents and gathers the results on rank 0.

Batches are right-padded and need no attention mask: in a causal model a token never sees what follows it.
Under FSDP every rank must run the same number of forward passes (each gathers the sharded weights); the
evaluator evens out the requests, and `_logits` evens out the batches that remain different (rolling windows).
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM

from src.data.tokenizer import Codec
from src.loop.batches import call_model


class LiveModel(TemplateLM):
    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, sharded: bool, codec: Codec,
                 max_length: int, batch_size: int, progress: Callable[[str], None] = lambda doing: None):
        super().__init__()
        self.accelerator, self.model, self.sharded, self.codec = accelerator, model, sharded, codec
        self.max_length, self.batch_size, self.progress = max_length, batch_size, progress
        self._rank, self._world_size = accelerator.process_index, accelerator.num_processes
        self._device = accelerator.device
        # What an empty context is conditioned on: the tokenizer's end of text, else a line break (char, byte).
        self._eot = codec.end_of_text if codec.end_of_text is not None else (codec.encode("\n") or [0])[0]

    # The evaluator's collectives, over the run's processes.
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor.to(self._device)) if self._world_size > 1 else tensor

    def gather_object(self, obj, dst: int = 0):
        gathered = gather_object([obj]) if self._world_size > 1 else [obj]
        return gathered if self._rank == dst else None

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def tokenizer_name(self) -> str:
        return self.codec.identity()[:64]

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        # The harness encodes a context and its continuation apart: a BOS token in front of each would put one in
        # the middle of every request (lm-eval's own HFLM adds none unless asked, as here).
        return self.codec.encode(string, special_tokens=bool(add_special_tokens))

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # no progress bar in the training log

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Each (context, continuation) pair's summed log-probability of the continuation, and whether greedy
        decoding would have produced it; the context is cut from the left to fit the model's positions."""
        sequences = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1):]
            sequences.append((whole, min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))  # alike lengths batch together
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        results: list[Optional[tuple[float, bool]]] = [None] * len(sequences)
        for b, logits in self._logits([[sequences[i][0][:-1] for i in batch] for batch in batches]):
            for row, i in enumerate(batches[b]):
                whole, n = sequences[i]
                inputs = len(whole) - 1
                targets = torch.tensor(whole[-n:], device=logits.device)
                scores = F.log_softmax(logits[row, inputs - n : inputs].float(), dim=-1)
                results[i] = (scores.gather(-1, targets[:, None]).sum().item(),
                              bool((scores.argmax(-1) == targets).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-probability (perplexity tasks), in windows of the model's length, as HFLM does."""
        windows, owner = [], []
        for i, (string,) in enumerate(request.args for request in requests):
            for window in map(harness_utils.make_disjoint_window, harness_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, one request at a time, until one of its `until` strings or max_gen_toks tokens
        (whole weights only: a sharded model is refused generation tasks before training)."""
        texts = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            # Context and continuation within the model's positions: max_gen_toks as far as the whole context
            # leaves room, and never so far that less than half the block is left to the context.
            ids = self.tok_encode(context) or [self._eot]
            new_tokens = min(options.get("max_gen_toks", 256), max(self.max_length - len(ids), self.max_length // 2))
            ids = ids[-(self.max_length - new_tokens):]
            generated = []
            for _ in range(new_tokens):
                logits = self._forward([ids + generated])
                token = int(logits[0, len(ids) + len(generated) - 1].argmax())
                if token == self._eot and self.codec.end_of_text is not None:
                    break
                generated.append(token)
                text = self.codec.decode(generated)
                if any(stop in text for stop in until):
                    break
            text = self.codec.decode(generated)
            for stop in until:
                text = text.split(stop)[0]
            texts.append(text)
        return texts

    def _logits(self, batches: list[list[list[int]]]):
        """Yields (index, logits) for each batch of token lists, one batch at a time."""
        extra = 0
        if self.sharded:  # every rank the same number of forward passes: the others' surplus, as dummy batches
            extra = max(gather_object([len(batches)])) - len(batches)
        for i, batch in enumerate(batches):
            self.progress(f"downstream task batch {i + 1} of {len(batches)}")
            yield i, self._forward(batch)
        for _ in range(extra):
            self._forward([[self._eot]])

    def _forward(self, batch: list[list[int]]) -> torch.Tensor:
        """The model's logits for token lists, right-padded with 0."""
        width = max(len(ids) for ids in batch)
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            tokens[row, : len(ids)] = torch.tensor(ids)
        with torch.no_grad(), self.accelerator.autocast():
            return call_model(self.model, {"input_ids": tokens.to(self._device)})

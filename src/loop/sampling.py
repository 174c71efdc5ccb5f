"""Text a person can read: continuations of prompts sampled from a language model, during training
(`trainer.sample_every`) or from an export (`python sample.py outputs/RUN/model`).

Sampling draws from its own seeded random state, so the same weights give the same text, and the training's
random state (dropout, data order) is left exactly as it was: a run that samples resumes bitwise, and trains
the weights of a run that does not.
"""

import logging
from typing import Callable, Optional

import torch

from src.data.tokenizer import Codec
from src.errors import UsageError

log = logging.getLogger(__name__)


def sample_texts(model: torch.nn.Module, codec: Codec, prompts: list[str], max_new_tokens: int,
                 temperature: float, top_k: Optional[int], seed: int, block_size: int,
                 progress: Callable[[str], None] = lambda doing: None) -> list[str]:
    """Each prompt followed by max_new_tokens sampled tokens, as text; `progress` hears of each prompt."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            texts = []
            for i, prompt in enumerate(prompts):
                progress(f"sampling prompt {i + 1} of {len(prompts)}")
                texts.append(codec.decode(_continuation(model, codec.encode(prompt), max_new_tokens, temperature,
                                                        top_k, block_size, device)))
            return texts
    finally:
        model.train(was_training)


def _continuation(model, ids: list[int], max_new_tokens: int, temperature: float, top_k: Optional[int],
                  block_size: int, device: torch.device) -> list[int]:
    if not ids:
        raise UsageError("an empty prompt: give each prompt at least one character")
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    if hasattr(model, "generation_config"):  # transformers: its own generate, bounded by its positions
        idx = idx[:, -(block_size - 1):]
        new = min(max_new_tokens, block_size - idx.shape[1])
        out = model.generate(input_ids=idx, attention_mask=torch.ones_like(idx), do_sample=True, max_new_tokens=new,
                             temperature=temperature, top_k=top_k or 0, top_p=1.0, pad_token_id=0)
    else:  # ours (src/models/gpt.py): it crops its context to the block size itself
        out = model.generate(idx, max_new_tokens, temperature, top_k)
    return out[0].tolist()


class Sampler:
    """trainer.sample_every: at those steps rank 0 continues each of trainer.sample_prompts with the weights
    being trained. What cannot sample is refused before the run starts."""

    def __init__(self, accelerator, trainer, codec: Optional[Codec], model: torch.nn.Module, block_size: int,
                 progress: Callable[[str], None] = lambda doing: None):
        self.accelerator, self.trainer, self.codec, self.block_size = accelerator, trainer, codec, block_size
        self.progress = progress  # the hang watch hears of every prompt
        self.every = trainer.sample_every
        if not self.every:
            return
        if codec is None:
            raise UsageError("trainer.sample_every needs text data that can encode prompts (data=text, data=jsonl); "
                             "this data option has no text")
        unwrapped = accelerator.unwrap_model(model)
        if not hasattr(unwrapped, "generate"):
            raise UsageError(f"trainer.sample_every: {type(unwrapped).__name__} has no "
                             "generate method (models/gpt.py and transformers models do)")
        if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
            raise UsageError("trainer.sample_every needs whole weights on rank 0; with sharded weights sample from "
                             "the export instead: python sample.py RUN_DIR/model")
        for prompt in trainer.sample_prompts:  # refused now, not at step sample_every
            try:
                if not codec.encode(prompt):
                    raise UsageError("an empty prompt: give each at least one character")
            except UsageError as error:
                raise UsageError(f"trainer.sample_prompts: {error}") from None

    def step_finished(self, step: int, model: torch.nn.Module) -> None:
        if not self.every or step % self.every or not self.accelerator.is_main_process:
            return
        trainer = self.trainer
        with self.accelerator.autocast():
            texts = sample_texts(self.accelerator.unwrap_model(model, keep_torch_compile=False), self.codec,
                                 list(trainer.sample_prompts), trainer.sample_tokens, trainer.sample_temperature,
                                 trainer.sample_top_k, trainer.seed, self.block_size, self.progress)
        # TensorBoard only: the other trackers take numbers (MLflow drops text with a warning per value).
        tensorboard = [t for t in self.accelerator.trackers if t.name == "tensorboard"]
        for i, text in enumerate(texts):
            log.info("sample %d at step %d:\n%s", i, step, text)
            for tracker in tensorboard:
                tracker.log({f"samples/{i}": f"```\n{text}\n```"}, step=step)  # markdown: keep the line breaks

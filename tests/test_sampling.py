"""Samples a person can read: seeded continuations of prompts during training (trainer.sample_every) and from an
export (sample.py), which leave the training exactly as it would have been."""

import sys

import pytest
import torch

from src.data.tokenizer import Codec
from src.errors import UsageError
from src.loop.sampling import sample_texts
from src.models.gpt import GPT
from tests.conftest import QUIET, TINY_GPT, exported_weights, max_abs_diff, named, run, scalars

CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=len(CHARS), block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1)


def test_the_same_seed_gives_the_same_text_and_the_training_state_is_left_as_it_was():
    model, codec = tiny_gpt(), Codec("char", CHARS)
    rng = torch.get_rng_state()
    first = sample_texts(model, codec, ["ROMEO:", "JULIET:"], 30, 0.8, 20, seed=1, block_size=16)
    assert torch.equal(torch.get_rng_state(), rng) and model.training  # dropout's RNG and mode untouched
    assert first == sample_texts(model, codec, ["ROMEO:", "JULIET:"], 30, 0.8, 20, seed=1, block_size=16)
    assert first != sample_texts(model, codec, ["ROMEO:", "JULIET:"], 30, 0.8, 20, seed=2, block_size=16)
    assert first[0].startswith("ROMEO:") and len(first[0]) == len("ROMEO:") + 30  # longer than the block: cropped


def test_top_k_of_one_samples_the_likeliest_token_whatever_the_seed():
    model = tiny_gpt().eval()
    ids = torch.tensor([[1, 2, 3]])
    greedy = ids
    for _ in range(5):
        greedy = torch.cat([greedy, model(greedy)[:, -1].argmax(-1, keepdim=True)], dim=1)
    for seed in (0, 1):
        torch.manual_seed(seed)
        assert torch.equal(model.generate(ids, 5, temperature=1.0, top_k=1), greedy)


@pytest.mark.parametrize("codec", [Codec("byte"), Codec("char", CHARS)], ids=["byte", "char"])
def test_a_codec_saved_with_an_export_encodes_and_decodes_as_the_data_did(tmp_path, codec):
    codec.save(tmp_path)
    loaded = Codec.load(tmp_path)
    assert loaded.encode("To be, or not") == codec.encode("To be, or not")
    assert loaded.decode(codec.encode("To be, or not")) == "To be, or not" and loaded.vocab_size == codec.vocab_size


def test_a_prompt_outside_a_character_vocabulary_is_refused_naming_the_characters():
    with pytest.raises(UsageError) as refused:
        Codec("char", CHARS).encode("é# ROMEO")
    named(str(refused.value), "'#é'")


@pytest.mark.slow  # 6 s (the suite's time: issue 48); CI runs it
def test_samples_during_training_are_logged_and_change_nothing_and_sample_py_repeats_them_from_the_export(tmp_path):
    args = [*TINY_GPT, *QUIET, "model.dropout=0.1", "trainer.max_steps=10", "trainer.eval_every=5"]
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    run([*args, f"hydra.run.dir={plain}"])
    run([*args, f"hydra.run.dir={sampled}", "trainer.sample_every=5", "trainer.sample_tokens=40",
         "trainer.sample_prompts=[ROMEO:,JULIET:]"])
    assert scalars(sampled, "train/loss") == scalars(plain, "train/loss")  # bitwise: dropout's RNG untouched
    assert max_abs_diff(exported_weights(sampled), exported_weights(plain)) == 0
    log = (sampled / "train.log").read_text()
    for step in (5, 10):
        assert f"sample 0 at step {step}:\nROMEO:" in log and f"sample 1 at step {step}:\nJULIET:" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(sampled / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/0/text_summary")
    assert [t.step for t in texts] == [5, 10]
    last = texts[-1].tensor_proto.string_val[0].decode()
    assert last.startswith("```\nROMEO:") and last.strip("`\n") in log

    def sample(*extra):  # its output: stdout and stderr merged
        return run([str(sampled / "model"), "--prompt", "ROMEO:", *extra], command=[sys.executable, "sample.py"],
                   check=False, timeout=120)

    once, again, other = sample("--tokens", "40", "--seed", "3"), sample("--tokens", "40", "--seed", "3"), \
        sample("--tokens", "40", "--seed", "4")
    assert once.returncode == 0, once.stdout
    assert once.stdout == again.stdout != other.stdout and once.stdout.startswith("ROMEO:")
    refused = sample("--prompt", "é")
    assert refused.returncode == 2 and "'é' are not in the data's vocabulary" in refused.stdout


def test_sampling_is_refused_before_training_without_text_or_with_a_prompt_the_data_cannot_encode():
    from accelerate import Accelerator

    from src.loop.sampling import Sampler
    from src.schema.trainer import TrainerConfig

    accelerator, model = Accelerator(cpu=True), tiny_gpt()
    Sampler(accelerator, TrainerConfig(sample_every=5, sample_prompts=("ROMEO:",)), Codec("char", CHARS), model, 16)
    with pytest.raises(UsageError) as refused:
        Sampler(accelerator, TrainerConfig(sample_every=5), None, model, 16)
    named(str(refused.value), "trainer.sample_every")
    with pytest.raises(UsageError) as refused:
        Sampler(accelerator, TrainerConfig(sample_every=5, sample_prompts=("ROMEO#",)), Codec("char", CHARS), model, 16)
    named(str(refused.value), "trainer.sample_prompts", "'ROMEO#'", "'#'")
    Sampler(accelerator, TrainerConfig(sample_every=0, sample_prompts=("ROMEO#",)), None, model, 16)  # off: no check

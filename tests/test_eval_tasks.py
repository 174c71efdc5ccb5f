"""trainer.eval_tasks: lm-evaluation-harness tasks scored on the live model during training, offline over the
repository's own task (data/eval_tasks/shakespeare_cloze.yaml over a local JSONL file)."""

import json

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from omegaconf import OmegaConf

from src.data.tokenizer import Codec
from src.errors import UsageError
from src.models.gpt import GPT
from tests.conftest import FSDP_ON_CPU, QUIET, ROOT, TINY_GPT, exported_weights, max_abs_diff, named, run, scalars

pytest.importorskip("lm_eval")

TASK = "data/eval_tasks/shakespeare_cloze.yaml"
SCORES = ["eval_tasks/shakespeare_cloze/acc", "eval_tasks/shakespeare_cloze/acc_norm"]
# Whole texts' log-likelihood in windows of the model's length: a rank's documents give it its own number of
# batches (36 documents: 16 and 17 batches of 4 windows), which FSDP's ranks must even out.
PERPLEXITY = "eval_tasks/shakespeare_perplexity/bits_per_byte"
# Dropout on: a harness that reseeded the training's generators would change the masks, so the losses.
ARGS = [*TINY_GPT, *QUIET, "model.dropout=0.1", "data.batch_size=8", "trainer.max_steps=4", "trainer.monitor=null"]
WITH_TASKS = [f"trainer.eval_tasks=[{TASK},data/eval_tasks/shakespeare_perplexity.yaml]", "trainer.eval_tasks_every=2",
              "trainer.eval_tasks_limit=36", "trainer.eval_tasks_batch_size=4", "trainer.eval_on_start=true"]


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval_tasks") / "scored"
    proc = run([*ARGS, *WITH_TASKS, f"hydra.run.dir={run_dir}"])
    assert "it/s]" not in proc.stdout, proc.stdout[-3000:]  # the harness's progress bars, drawn at each scoring
    return run_dir


def test_tasks_are_scored_at_their_steps_and_the_training_is_the_one_without_them(scored_run, tmp_path):
    plain = tmp_path / "plain"
    run([*ARGS, "trainer.eval_on_start=true", f"hydra.run.dir={plain}"])
    assert sorted(scalars(scored_run, PERPLEXITY)) == [0, 2, 4]
    for tag in SCORES:
        assert sorted(scalars(scored_run, tag)) == [0, 2, 4]
        assert all(0 <= value <= 1 for value in scalars(scored_run, tag).values())
    assert scalars(scored_run, "train/loss") == scalars(plain, "train/loss")
    assert max_abs_diff(exported_weights(scored_run), exported_weights(plain)) == 0
    summary = json.loads((scored_run / "summary.json").read_text())
    assert set(SCORES) <= set(summary["final_metrics"])


@pytest.mark.parametrize("layout", [pytest.param("ddp", marks=pytest.mark.slow),  # 7.5 s each: the suite's time
                                    pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_processes_score_each_document_once_and_the_best_checkpoint_follows_the_monitored_score(
        scored_run, tmp_path, layout):
    """Each rank scores its share of the documents; at step 0 (the same weights) the scores are one process's.
    Under FSDP every rank runs the same number of sharded forward passes."""
    run_dir = tmp_path / "run"
    monitor = ["trainer.monitor=eval_tasks/shakespeare_cloze/acc", "trainer.monitor_mode=max",
               "trainer.eval_tasks_every=1", "data.batch_size=4", "trainer.max_steps=3"]
    run([*ARGS, *WITH_TASKS, *monitor, f"hydra.run.dir={run_dir}"], nproc=2, timeout=120,  # a hang: 8 s here
        **(FSDP_ON_CPU if layout == "fsdp" else {}))
    for tag in SCORES:
        assert scalars(run_dir, tag)[0] == scalars(scored_run, tag)[0]
    assert scalars(run_dir, PERPLEXITY)[0] == pytest.approx(scalars(scored_run, PERPLEXITY)[0], rel=1e-6)
    accuracy = {step: value for step, value in scalars(run_dir, SCORES[0]).items() if step}  # step 0: no checkpoint
    best = json.loads((run_dir / "summary.json").read_text())["best"]
    first_best = min(step for step, value in accuracy.items() if value == max(accuracy.values()))
    assert best == {"metric": SCORES[0], "value": pytest.approx(max(accuracy.values())), "step": first_best}


@pytest.fixture
def accelerator():
    return Accelerator(cpu=True)


def tiny_gpt_and_codec(block_size: int = 32):
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    codec = Codec("char", chars="".join(sorted(set(text))))
    torch.manual_seed(0)
    return GPT(vocab_size=codec.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32), codec


def test_a_continuations_score_is_its_log_probability_under_the_model_whatever_batch_it_is_padded_in(accelerator):
    """What the harness asks (context, continuation), scored in padded batches of mixed lengths, equals the
    model's log-probability of each continuation alone; a context longer than the model is cut from the left."""
    from src.loop.harness_model import LiveModel

    model, codec = tiny_gpt_and_codec(block_size=32)
    model.eval()
    lm = LiveModel(accelerator, model, False, codec, max_length=32, batch_size=3)
    pairs = [("ROMEO:\nBut soft", ", what light"), ("A", "B"), ("JULIET:\n" * 8, "O Romeo"), ("Is it", " so?"),
             ("", "Nothing")]
    requests = [((c, x), codec.encode(c) or [lm.eot_token_id], codec.encode(x)) for c, x in pairs]
    scored = lm._loglikelihood_tokens(requests)
    for (_, context, continuation), (logprob, greedy) in zip(requests, scored):
        whole = (context + continuation)[-33:]
        with torch.no_grad():
            scores = F.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), -1)[-len(continuation):]
        targets = torch.tensor(continuation)
        assert logprob == pytest.approx(scores.gather(-1, targets[:, None]).sum().item(), abs=1e-4)
        assert greedy == bool((scores.argmax(-1) == targets).all())


def test_a_generation_is_the_models_greedy_continuation_cut_at_the_first_stop_string(accelerator):
    """generate_until (a generation task, data/eval_tasks/shakespeare_next_words.yaml): token by token the model's
    most likely next one, for at most max_gen_toks tokens, the text cut before the first `until` string."""
    from types import SimpleNamespace

    from src.loop.harness_model import LiveModel

    model, codec = tiny_gpt_and_codec(block_size=32)
    model.eval()
    lm = LiveModel(accelerator, model, False, codec, max_length=32, batch_size=3)

    def greedy(context: str, new_tokens: int) -> str:
        ids = codec.encode(context)[-(32 - new_tokens):]
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return codec.decode(ids[-new_tokens:])

    contexts = ["ROMEO:\nBut soft", "JULIET:\n" * 6]
    free = [greedy(context, 12) for context in contexts]
    stop = free[0][3]  # a character the first continuation meets after 3 others
    requests = [SimpleNamespace(args=(contexts[0], {"until": [stop], "max_gen_toks": 12})),
                SimpleNamespace(args=(contexts[1], {"until": [], "max_gen_toks": 12})),
                SimpleNamespace(args=(contexts[1], {"until": "\x00", "max_gen_toks": 5})),
                # More than the block holds: half of it is generated after the context's last half, within the
                # model's 32 positions (not 40 tokens after one of context, past them).
                SimpleNamespace(args=(contexts[1], {"until": [], "max_gen_toks": 40}))]
    assert lm.generate_until(requests) == [free[0].split(stop)[0], free[1], greedy(contexts[1], 5),
                                           greedy(contexts[1], 16)]


def trainer_config(**keys):
    return OmegaConf.create({"eval_tasks": [TASK], "eval_tasks_every": 0, "eval_tasks_limit": None,
                             "eval_tasks_batch_size": 8, "max_steps": 4, "monitor": None, **keys})


@pytest.mark.parametrize("keys, names", [
    ({"monitor": "eval_tasks/shakespeare_cloze/f1"},
     ("trainer.monitor=eval_tasks/shakespeare_cloze/f1", "eval_tasks/shakespeare_cloze/acc",
      "eval_tasks/shakespeare_cloze/acc_norm")),
    ({"eval_tasks": ["data/eval_tasks/missing.yaml"]}, ("trainer.eval_tasks", "data/eval_tasks/missing.yaml")),
], ids=["unknown-score", "missing-file"])
def test_what_the_tasks_cannot_give_is_refused_before_training_naming_what_can(accelerator, keys, names):
    from src.loop.eval_tasks import EvalTasks

    model, codec = tiny_gpt_and_codec()
    with pytest.raises(UsageError) as refused:
        EvalTasks(accelerator, model, codec, trainer_config(**keys), block_size=32)
    named(str(refused.value), *names)

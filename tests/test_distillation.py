"""objective=distill: a student trained towards a teacher's next-token distributions, with the teacher's ids checked
against the data's, exact on any layout like every objective, and scored by eval.py with its teacher."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from src.objectives.distillation import CausalLMDistillation, Distillation
from tests.conftest import (
    FSDP_ON_CPU,
    QUIET,
    TINY_GPT,
    exported_weights,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
)

FAST = ["optimizer.lr=1e-2", "scheduler=constant"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A character-level GPT trained far enough that its distributions are far from a fresh student's."""
    run_dir = tmp_path_factory.mktemp("distill") / "teacher"
    run([*TINY_GPT, *QUIET, *FAST, "trainer.max_steps=60", f"hydra.run.dir={run_dir}"])
    return run_dir


def distill(run_dir: Path, teacher: Path, *extra: str, nproc: int = 1, check: bool = True):
    return run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={teacher / 'model'}",
                "model.n_embd=16", "trainer.max_steps=12", f"hydra.run.dir={run_dir}", *extra], nproc=nproc,
               check=check)


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_the_divergence_is_the_kl_of_the_two_distributions_at_the_temperature_over_counted_targets(divergence):
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 13)  # the teacher's output layer is wider (padding)
    targets = torch.randint(0, 11, (2, 5))
    targets[1, 3] = -100
    objective = Distillation(teacher="unused", kd_ratio=0.25, temperature=2.0, divergence=divergence)
    ce, kl = objective.token_terms(student, teacher, targets)
    p_student, p_teacher = Categorical(logits=student / 2.0), Categorical(logits=teacher[..., :11] / 2.0)
    expected = kl_divergence(p_teacher, p_student) if divergence == "forward" else kl_divergence(p_student, p_teacher)
    counted = targets != -100
    assert torch.allclose(kl[counted], expected[counted], atol=1e-6) and kl[~counted].eq(0).all()
    assert torch.allclose(ce[counted], -torch.log_softmax(student, -1).gather(-1, targets.clamp(min=0)[..., None])
                          [..., 0][counted], atol=1e-6)
    assert torch.allclose(objective.mixed(ce, kl), 0.75 * ce + 0.25 * 4.0 * kl)
    assert kl.sum() > 0 and objective.token_terms(student, student, targets)[1].abs().max() < 1e-6


def test_the_causal_lm_form_shifts_both_models_logits_with_the_labels():
    torch.manual_seed(0)
    student, teacher, labels = torch.randn(1, 6, 7), torch.randn(1, 6, 7), torch.randint(0, 7, (1, 6))
    shifted = CausalLMDistillation(teacher="unused").token_terms(student, teacher, labels)
    plain = Distillation(teacher="unused").token_terms(student[:, :-1], teacher[:, :-1], labels[:, 1:])
    assert all(torch.equal(a, b) for a, b in zip(shifted, plain))


def test_a_student_started_from_its_teacher_diverges_by_nothing_and_a_smaller_one_closes_the_gap(teacher, tmp_path):
    same = tmp_path / "same"
    run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={teacher / 'model'}",
         f"trainer.init_weights={teacher / 'model'}", "trainer.max_steps=1", f"hydra.run.dir={same}"])
    assert scalars(same, "train/kl")[1] == 0  # the teacher read the same inputs, aligned the same way
    rounded = tmp_path / "rounded"
    proc = run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={teacher / 'model'}",
                "objective.teacher_dtype=bfloat16", f"trainer.init_weights={teacher / 'model'}", "trainer.max_steps=1",
                f"hydra.run.dir={rounded}"])
    named(proc.stdout, "parameters in bfloat16")
    assert 0 < abs(scalars(rounded, "train/kl")[1]) < 1e-3  # the same teacher, its weights rounded to bf16
    small = tmp_path / "small"
    proc = distill(small, teacher, "objective.kd_ratio=1", "trainer.eval_on_start=true")
    named(proc.stdout, "objective=distill: teacher", "forward KL")
    kl = scalars(small, "eval/kl")
    assert kl[12] < 0.5 * kl[0]
    assert scalars(small, "eval/loss") == kl  # kd_ratio=1: the loss is the divergence alone


def test_with_no_distillation_term_the_student_trains_as_cross_entropy_trains_it(teacher, tmp_path):
    distill(tmp_path / "kd0", teacher, "objective.kd_ratio=0")
    run([*TINY_GPT, *QUIET, *FAST, "model.n_embd=16", "trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'ce'}"])
    assert max_abs_diff(exported_weights(tmp_path / "kd0"), exported_weights(tmp_path / "ce")) <= 1e-6


def test_distillation_is_exact_on_two_processes_and_eval_py_scores_the_student_with_its_teacher(teacher, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    distill(one, teacher, "data.batch_size=8", "trainer.gradient_accumulation_steps=2")
    distill(two, teacher, "data.batch_size=8", nproc=2)
    assert max_abs_diff(exported_weights(one), exported_weights(two)) <= 1e-5
    kl_one, kl_two = scalars(one, "train/kl"), scalars(two, "train/kl")
    assert max(abs(kl_one[s] - kl_two[s]) for s in kl_one) <= 1e-5
    run([f"path={two / 'model'}", "eval_batches=4"], script="eval.py")
    scored = json.loads((two / "model" / "eval_metrics.json").read_text())
    assert abs(scored["eval/kl"] - scalars(two, "eval/kl")[12]) <= 1e-5


def test_a_hub_teachers_commit_is_recorded_and_eval_py_reads_it_after_the_hub_has_moved_on(teacher, tmp_path):
    """A teacher named by a hub id is read at its newest revision, A, whose commit the run records as
    objective.teacher_revision; then main moves to B, another model: eval.py still scores the student against A,
    as the run's last evaluation did."""
    from omegaconf import OmegaConf

    from tests.conftest import HF_HOME, put_in_hub_cache

    repo_id, a, b = f"tiny-org/teacher-{tmp_path.name}", "a" * 40, "b" * 40
    put_in_hub_cache(teacher / "model", Path(HF_HOME), repo_id, commit=a)
    run_dir = tmp_path / "student"
    run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={repo_id}", "model.n_embd=16",
         "trainer.max_steps=4", f"hydra.run.dir={run_dir}"])
    assert OmegaConf.load(run_dir / "config.yaml").objective.teacher_revision == a
    put_in_hub_cache(run_dir / "model", Path(HF_HOME), repo_id, commit=b)  # main -> B: the student itself
    run([f"path={run_dir / 'model'}", "eval_batches=4"], script="eval.py")
    scored = json.loads((run_dir / "model" / "eval_metrics.json").read_text())
    assert scored["eval/kl"] > 0.1 and abs(scored["eval/kl"] - scalars(run_dir, "eval/kl")[4]) <= 1e-5


def test_a_teacher_whose_ids_mean_other_tokens_is_refused_before_training(tmp_path):
    bytes_teacher = tmp_path / "bytes_teacher"
    run([*TINY_GPT, *QUIET, "data.level=byte", "trainer.max_steps=1", f"hydra.run.dir={bytes_teacher}"])
    proc = distill(tmp_path / "student", bytes_teacher, check=False)
    refused(proc, f"objective.teacher={bytes_teacher / 'model'}", "bytes", "the 65 characters")
    assert not (tmp_path / "student" / "checkpoints").exists()


def test_a_checkpoint_teaches_as_its_export_does_and_a_transformers_folder_teaches_on_its_tokenizers_ids(
        teacher, pretrained, tmp_path):
    from_export, from_checkpoint = tmp_path / "from_export", tmp_path / "from_checkpoint"
    distill(from_export, teacher, "trainer.max_steps=2")
    checkpoint = teacher / "checkpoints" / "step_00000060"
    run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={checkpoint}", "model.n_embd=16",
         "trainer.max_steps=2", f"hydra.run.dir={from_checkpoint}"])
    assert scalars(from_checkpoint, "train/kl") == scalars(from_export, "train/kl")
    from_transformers = tmp_path / "from_transformers"
    run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={pretrained}", "objective.kd_ratio=1",
         f"data.tokenizer={pretrained}", "trainer.max_steps=12", "trainer.eval_on_start=true",
         f"hydra.run.dir={from_transformers}"])
    kl = scalars(from_transformers, "eval/kl")
    assert kl[12] < 0.7 * kl[0]


def test_a_transformers_student_distils_from_a_transformers_teacher_on_labels_in_hugging_faces_convention(
        pretrained, tmp_path):
    run_dir = tmp_path / "hf_student"
    run(["model=hf_causal_lm", "model.config.n_layer=1", "model.config.n_head=2", "model.config.n_embd=16",
         "data=jsonl", f"data.tokenizer={pretrained}", "objective=distill_causal_lm", f"objective.teacher={pretrained}",
         "objective.kd_ratio=1", *QUIET, *FAST, "data.batch_size=8", "trainer.max_steps=12",
         "trainer.eval_on_start=true", f"hydra.run.dir={run_dir}"])
    kl = scalars(run_dir, "eval/kl")
    assert kl[12] < 0.7 * kl[0]


def test_under_fsdp_a_transformers_teacher_is_read_in_slices_and_teaches_what_a_whole_copy_teaches(pretrained,
                                                                                                    tmp_path):
    """A transformers folder's weights read in the dtype its config names, then cast to objective.teacher_dtype."""
    args = ["model=hf_causal_lm", "model.config.n_layer=1", "model.config.n_head=2", "model.config.n_embd=16",
            "data=jsonl", f"data.tokenizer={pretrained}", "objective=distill_causal_lm",
            f"objective.teacher={pretrained}", "objective.teacher_dtype=bfloat16", *QUIET, *FAST, "data.batch_size=8",
            "trainer.max_steps=3"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    run([*args, f"hydra.run.dir={ddp}"], nproc=2)
    proc = run([*args, f"hydra.run.dir={fsdp}"], nproc=2, **FSDP_ON_CPU)
    named(proc.stdout, "in bfloat16, frozen, sharded over the processes, each rank read its own slices")
    kl_ddp, kl_fsdp = scalars(ddp, "train/kl"), scalars(fsdp, "train/kl")
    assert sorted(kl_fsdp) == [1, 2, 3] and kl_ddp[1] > 0.1
    assert max(abs(kl_ddp[s] - kl_fsdp[s]) for s in kl_ddp) <= 1e-4 * kl_ddp[1]


@pytest.mark.slow  # four launches, one of them training a 76M-parameter teacher
def test_under_fsdp_no_rank_holds_the_teacher_whole_before_the_first_step(tmp_path):
    """Each rank's resident peak before the first step (the run's summary) with a large teacher, over the same run
    with a small one: its shard and a weight or two, not the 0.28 GiB of the whole teacher (nor the buffers of a
    broadcast of it from rank 0)."""
    large, small = tmp_path / "large", tmp_path / "small"
    run([*TINY_GPT, *QUIET, *FAST, "model.n_layer=24", "model.n_head=8", "model.n_embd=512", "trainer.max_steps=1",
         "data.batch_size=2", f"hydra.run.dir={large}"])
    run([*TINY_GPT, *QUIET, *FAST, "trainer.max_steps=1", f"hydra.run.dir={small}"])
    whole = (large / "model" / "model.safetensors").stat().st_size / 2**30

    def start_up_peaks(teacher: Path) -> list[float]:
        run_dir = tmp_path / f"student_of_{teacher.name}"
        run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={teacher / 'model'}",
             "model.n_embd=16", "data.batch_size=8", "trainer.max_steps=1", f"hydra.run.dir={run_dir}"], nproc=2,
            **FSDP_ON_CPU)
        return json.loads((run_dir / "summary.json").read_text())["peak_memory_gib"][
            "rss_per_rank_before_the_first_step"]

    held = [a - b for a, b in zip(start_up_peaks(large), start_up_peaks(small))]
    # measured: 0.142 GiB on each rank (half of 0.282, and a weight); each rank's whole copy read first: 0.55
    assert whole > 0.25 and len(held) == 2 and max(held) < 0.6 * whole, (held, whole)


def distilling(objective: Distillation, teacher: torch.nn.Module) -> Distillation:
    """The objective as start() leaves it, with this teacher (start() loads one from a folder)."""
    from accelerate import Accelerator

    objective.teacher, objective.accelerator = teacher.eval().requires_grad_(False), Accelerator(cpu=True)
    objective._sums = torch.zeros(2)
    return objective


def trained_and_evaluated(objective: Distillation, model: torch.nn.Module, inputs, targets, compile: bool = False):
    """A micro-step's loss sum, gradients and train/ce, train/kl sums; an evaluation's metrics of the same batch."""
    from src.loop.forward import Forward

    forward = Forward(objective, compile=compile)
    model.zero_grad()
    loss = forward.loss_sum(model, inputs, targets)
    loss.backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        metrics = {name: (v.sum() / w.sum()) for name, (v, w) in forward.metrics(model, inputs, targets).items()}
    return loss.detach(), gradients, objective.training_metrics(), metrics


@pytest.mark.parametrize("model_kind", ["gpt", "transformers llama"])
@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_chunked_distillation_trains_and_evaluates_as_the_whole_logits_do(model_kind, divergence):
    """objective.chunk_tokens: both terms through the student's output layer 7 targets at a time (uneven chunks,
    some targets ignored, the teacher's output layer wider) give the loss, gradients, train/ce, train/kl and
    evaluation metrics of the whole logits; neither model's logits of the whole batch are ever computed (the
    teacher gives its last hidden states, turned into logits chunk by chunk with the student's)."""
    from src.models.gpt import GPT
    from tests.test_chunked_loss import whole_logits_seen

    torch.manual_seed(0)
    if model_kind == "gpt":
        student = GPT(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_embd=16)
        teacher = GPT(vocab_size=104, block_size=32, n_layer=2, n_head=2, n_embd=32)
        inputs, targets, form = torch.randint(0, 97, (3, 32)), torch.randint(0, 97, (3, 32)), Distillation
    else:
        from tests.test_chunked_loss import tiny_llama

        student, teacher = tiny_llama(), tiny_llama()  # two draws of the same shape
        ids = torch.randint(0, 97, (2, 24))
        inputs, targets, form = {"input_ids": ids}, ids.clone(), CausalLMDistillation
    targets[0, :5] = -100
    terms = {"kd_ratio": 0.3, "temperature": 2.0, "divergence": divergence}
    plain = trained_and_evaluated(distilling(form(teacher="unused", **terms), teacher), student, inputs, targets)
    with whole_logits_seen(97) as seen_97, whole_logits_seen(104) as seen_104:
        chunked = trained_and_evaluated(distilling(form(teacher="unused", chunk_tokens=7, **terms), teacher),
                                        student, inputs, targets)
    assert seen_97 == seen_104 == []
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-5)
    assert chunked[1].keys() == plain[1].keys() and plain[1]
    for name in plain[1]:
        torch.testing.assert_close(chunked[1][name], plain[1][name], rtol=1e-5, atol=1e-6, msg=name)
    for got, expected in zip(chunked[2:], plain[2:]):  # train/ce, train/kl; eval's loss, accuracy, ce, kl
        assert got.keys() == expected.keys() and len(got) >= 2
        for name in got:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
    assert plain[2]["kl"] > 0 and plain[3]["accuracy"] >= 0


def test_a_teacher_that_changes_its_logits_after_its_output_layer_teaches_by_its_whole_logits(caplog):
    """Soft-capping (Gemma 2): the teacher's output layer alone would give other logits, so with
    chunk_tokens its logits are computed whole, as without it, said once in the log; the student still chunks."""
    from tests.test_chunked_loss import tiny_llama, whole_logits_seen

    torch.manual_seed(0)
    student, teacher = tiny_llama(), tiny_llama()
    plain_forward = type(teacher).forward

    class SoftCapsItsLogits(type(teacher)):  # as Gemma 2's final_logit_softcapping, at a cap of 1
        def forward(self, *args, **kwargs):
            out = plain_forward(self, *args, **kwargs)
            out.logits = torch.tanh(out.logits)
            return out

    teacher.__class__ = SoftCapsItsLogits
    ids = torch.randint(0, 97, (2, 24))
    plain = trained_and_evaluated(distilling(CausalLMDistillation(teacher="unused"), teacher), student,
                                  {"input_ids": ids}, ids)
    with whole_logits_seen(97) as seen, caplog.at_level("WARNING"):
        chunked = trained_and_evaluated(distilling(CausalLMDistillation(teacher="unused", chunk_tokens=7), teacher),
                                        student, {"input_ids": ids}, ids)
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-5)
    # the teacher's output layer and the teacher, in the step and in the evaluation; the student's never
    assert sorted(name for name, _ in seen) == ["Linear", "Linear", "SoftCapsItsLogits", "SoftCapsItsLogits"]
    assert [r.message for r in caplog.records].count(
        "objective.chunk_tokens: the teacher's logits are computed whole for each micro-batch, not chunk by chunk: "
        "it changes its logits after its output layer (soft-capping, a logit scale)") == 1


@pytest.mark.slow  # about a minute of compilation on a 2-core CPU; CI runs it
def test_chunked_distillation_compiles_to_the_loss_gradients_and_metrics_of_the_whole_logits():
    from src.models.gpt import GPT

    torch.manual_seed(0)
    student = GPT(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_embd=16)
    teacher = GPT(vocab_size=104, block_size=32, n_layer=2, n_head=2, n_embd=32)
    inputs, targets = torch.randint(0, 97, (3, 32)), torch.randint(0, 97, (3, 32))
    targets[0, :5] = -100
    plain = trained_and_evaluated(distilling(Distillation(teacher="unused"), teacher), student, inputs, targets)
    compiled = trained_and_evaluated(distilling(Distillation(teacher="unused", chunk_tokens=7), teacher), student,
                                     inputs, targets, compile=True)
    torch.testing.assert_close(compiled[0], plain[0], rtol=1e-5, atol=1e-5)
    for name in plain[1]:
        torch.testing.assert_close(compiled[1][name], plain[1][name], rtol=1e-5, atol=1e-6, msg=name)
    for got, expected in zip(compiled[2:], plain[2:]):
        assert got.keys() == expected.keys()
        for name in got:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_compiled_student_reads_the_teachers_logits_computed_outside_its_graph(teacher, tmp_path):
    run_dir = tmp_path / "compiled"
    run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={teacher / 'model'}",
         f"trainer.init_weights={teacher / 'model'}", "trainer.max_steps=2", "trainer.compile=true",
         f"hydra.run.dir={run_dir}"])
    kl, ce = scalars(run_dir, "train/kl"), scalars(run_dir, "train/ce")
    assert abs(kl[1]) < 1e-6 and sorted(ce) == [1, 2] and ce[1] > 1  # the terms summed inside the compiled step


def test_under_fsdp_the_teacher_is_sharded_as_the_student_and_trains_what_ddp_trains(teacher, tmp_path):
    """The FSDP run also computes both terms in chunks (objective.chunk_tokens) through the sharded output layer."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    distill(ddp, teacher, "data.batch_size=8", "trainer.max_steps=4", nproc=2)
    proc = run([*TINY_GPT, *QUIET, *FAST, "objective=distill", f"objective.teacher={teacher / 'model'}",
                "objective.chunk_tokens=7", "model.n_embd=16", "data.batch_size=8", "trainer.max_steps=4",
                f"hydra.run.dir={fsdp}"], nproc=2, **FSDP_ON_CPU)
    named(proc.stdout, "frozen, sharded over the processes, each rank read its own slices")
    kl_ddp, kl_fsdp = scalars(ddp, "train/kl"), scalars(fsdp, "train/kl")
    assert sorted(kl_fsdp) == [1, 2, 3, 4] and max(abs(kl_ddp[s] - kl_fsdp[s]) for s in kl_ddp) <= 1e-5
    assert max_abs_diff(exported_weights(ddp), exported_weights(fsdp)) <= 1e-5

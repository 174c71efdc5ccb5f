"""Knowledge distillation: a student trained towards a teacher's next-token distributions (objective=distill).

Per counted target, the loss is

    (1 - kd_ratio) x cross-entropy with the data's token  +  kd_ratio x temperature² x KL(teacher || student)

with both distributions at `temperature` (Hinton et al. 2015; torchtune's knowledge-distillation recipe mixes the
two the same way, forward KL at temperature 1). `divergence=reverse` takes KL(student || teacher) instead (MiniLLM:
the student covers the teacher's main modes rather than all of them). Like every objective it returns sums over
the counted targets (src/objectives/base.py), so the loss is exact on any number of processes and accumulation.

The teacher is an export (RUN/model), a checkpoint (RUN/checkpoints/step_N) or a transformers folder or hub id,
loaded once per process, frozen, and run without gradients under the student's autocast, outside the compiled
step (with_reference, as DPO's reference model). Its ids must mean the data's tokens: its tokenizer or
vocabulary.json is compared with the data's before anything trains. Both models' logits are compared over the
vocabulary they share (a model may pad its output layer past the tokenizer's size). With objective.chunk_tokens both
terms come from the student's output layer a chunk of targets at a time (src/objectives/chunked.py), and the
teacher gives its last hidden states, made into its logits chunk by chunk there: neither model's logits of a whole
micro-batch are held.
"""

import logging
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from src.checkpointing.training_state import sharded
from src.data.tokenizer import check_same_ids
from src.errors import UsageError
from src.loop.batches import call_model
from src.models.hf_causal_lm import output_width
from src.models.pretrained_slices import export_without_values, shard_frozen
from src.objectives.base import PerSample
from src.objectives.chunked import CHECKED_TOKENS, output_layer, output_layer_gives_hidden_states
from src.objectives.classification import CausalLM, CrossEntropy
from src.schema.signature import Arg

log = logging.getLogger(__name__)


class Distillation(CrossEntropy):
    """Targets given by the data as the next tokens (data=text, tokens, shards), as objective=cross_entropy."""

    metric_names = ("loss", "accuracy", "ce", "kl")

    def __init__(
        self,
        teacher: Annotated[str, Arg(
            "the teacher: an export (RUN/model), a checkpoint (RUN/checkpoints/step_N), or a transformers "
            "from_pretrained folder or hub id; its ids must mean the data's tokens")],
        kd_ratio: Annotated[float, Arg("weight of the distillation term; 1 - kd_ratio weighs the cross-entropy "
                                       "with the data's tokens", ge=0, le=1)] = 0.5,
        temperature: Annotated[float, Arg("softens both distributions; the term is scaled by its square, so "
                                          "its gradients keep their size", gt=0)] = 1.0,
        divergence: Annotated[Literal["forward", "reverse"], Arg(
            "forward: KL(teacher || student), the student covers all the teacher's mass; reverse: "
            "KL(student || teacher), it seeks the teacher's main modes (MiniLLM)")] = "forward",
        teacher_revision: Annotated[Optional[str], Arg(
            "with a hub id: its branch, tag or commit (null: the newest, whose commit the run's config then records, "
            "so that a resume or an evaluation reads the same teacher)")] = None,
        teacher_dtype: Annotated[Optional[Literal["float32", "bfloat16", "float16"]], Arg(
            "the teacher's weights in this dtype, e.g. bfloat16 to halve its memory where the student trains under "
            "bf16 autocast, which computes in bf16 anyway (null: as stored)")] = None,
        ignore_index: Annotated[int, Arg("target value that counts for nothing")] = -100,
        chunk_tokens: Annotated[Optional[int], Arg(
            "compute both terms through the student's output layer this many tokens at a time, the teacher's "
            "logits from its last hidden states likewise, recomputing each chunk's logits in the backward pass, so "
            "that neither model's logits of a whole micro-batch are held (large vocabularies); null: at once",
            ge=1)] = None,
        target_key: Annotated[str, Arg("the batch key holding the targets (mapping batches)")] = "labels",
    ):
        super().__init__(ignore_index=ignore_index, chunk_tokens=chunk_tokens, target_key=target_key)
        self.teacher_path, self.kd_ratio, self.temperature, self.divergence = (
            teacher, kd_ratio, temperature, divergence)
        self.teacher_dtype = getattr(torch, teacher_dtype) if teacher_dtype else None
        self.teacher_revision = teacher_revision
        self.teacher: Optional[torch.nn.Module] = None
        self.accelerator = None
        self._sums: Optional[torch.Tensor] = None  # this rank's (cross-entropy, KL) since the last logging step
        self._teacher_in_chunks: Optional[bool] = None  # chunk_tokens: the teacher's logits chunk by chunk too

    # What the loop calls -----------------------------------------------------------------------------------------

    def start(self, accelerator, model: torch.nn.Module, data, run_dir, checkpoint) -> None:
        self.load_teacher(accelerator, data, accelerator.unwrap_model(model))
        # Before the first micro-batch, so that every (compiled) step adds to a tensor: one graph, not two.
        self._sums = torch.zeros(2, device=accelerator.device)

    def with_reference(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> Mapping:
        if self.teacher is None:
            raise RuntimeError("objective=distill: start() was not called, so there is no teacher")
        with torch.no_grad(), self.accelerator.autocast():  # the student's precision; the teacher is not prepared
            if self.chunk_tokens is not None and self._teacher_logits_are_its_output_layers(inputs):
                # its last hidden states and output layer: the student's turns them into logits chunk by chunk
                with output_layer_gives_hidden_states(self.teacher) as head:
                    hidden = call_model(self.teacher, inputs)
                self._reshard_teacher()
                return {"student": inputs, "teacher_hidden": hidden, "teacher_head": self._held(head[0])}
            teacher_logits = call_model(self.teacher, inputs)
        self._reshard_teacher()
        return {"student": inputs, "teacher_logits": teacher_logits}

    def _reshard_teacher(self) -> None:
        """Under FSDP, the teacher's weights back to each rank's shard. FSDP2 keeps the root module's own weights
        (embeddings, final norm, output layer) gathered after a forward, for the backward that usually follows;
        none follows a frozen teacher's, so they would stay gathered through the student's step (at 70B with a
        128k vocabulary, about 4 GB on every GPU)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.teacher.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _teacher_logits_are_its_output_layers(self, inputs: Any) -> bool:
        """Once, on a prefix of the first micro-batch: whether the teacher's logits are its output layer's product
        of its last hidden states. Not for a model that changes them after that layer (Gemma 2's soft-capping): its
        logits are then computed whole, as without chunk_tokens, and the log says so."""
        if self._teacher_in_chunks is None:
            prefix = (slice(0, 1), slice(0, CHECKED_TOKENS))
            cut = {k: v[prefix] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v for k, v in inputs.items()} \
                if isinstance(inputs, Mapping) else inputs[prefix]
            try:
                output_layer(self.teacher)
            except UsageError:
                self._teacher_in_chunks = False
                why = "its output layer is not a Linear found by get_output_embeddings()"
            else:
                plain = call_model(self.teacher, cut).float()
                with output_layer_gives_hidden_states(self.teacher) as head:
                    hidden = call_model(self.teacher, cut)
                chunked = F.linear(hidden, *self._held(head[0])).float()
                self._teacher_in_chunks = chunked.shape == plain.shape and torch.allclose(chunked, plain, rtol=1e-3,
                                                                                          atol=1e-3)
                why = "it changes its logits after its output layer (soft-capping, a logit scale)"
            if not self._teacher_in_chunks and self.accelerator.is_main_process:
                log.warning("objective.chunk_tokens: the teacher's logits are computed whole for each micro-batch, "
                            "not chunk by chunk: %s", why)
        return self._teacher_in_chunks

    def model_loss_sum(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> torch.Tensor:
        ce, kl = self.token_terms(call_model(model, inputs["student"]), inputs["teacher_logits"], targets)
        if self._sums is not None:
            self._sums = self._sums + torch.stack([ce.sum(), kl.sum()]).detach()
        return self.mixed(ce, kl).sum()

    def model_metrics(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> dict[str, PerSample]:
        logits = call_model(model, inputs["student"])
        ce, kl = self.token_terms(logits, inputs["teacher_logits"], targets)
        aligned_logits, aligned = self.aligned(logits, targets)
        return self._metrics_of_terms(ce, kl, aligned_logits.argmax(-1) == aligned, aligned)

    def training_metrics(self) -> dict[str, torch.Tensor]:
        """train/ce and train/kl per counted target (the loop divides the sums by the step's count)."""
        if self._sums is None:
            return {}
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        return {"ce": sums[0], "kl": sums[1]}

    def _held(self, head: tuple) -> tuple:
        """The teacher's output layer (weight, bias) as its forward saw them; under FSDP, where _reshard_teacher
        freed the gathered weight, gathered again (each rank), to be held through the student's step alone."""
        layer = output_layer(self.teacher)
        return tuple(seen if seen is None or seen.untyped_storage().size() > 0 else getattr(layer, name).full_tensor()
                     for seen, name in zip(head, ("weight", "bias")))

    # The loss ----------------------------------------------------------------------------------------------------

    def mixed(self, ce: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
        return (1 - self.kd_ratio) * ce + self.kd_ratio * self.temperature ** 2 * kl

    def token_terms(self, logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per aligned target: the cross-entropy with the data's token and the divergence from the teacher, both 0
        where the target counts for nothing. In fp32, as cross_entropy computes its loss."""
        logits, aligned = self.aligned(logits, targets)
        teacher_logits, _ = self.aligned(teacher_logits, targets)
        return self.terms(logits, teacher_logits, aligned)

    def terms(self, logits: torch.Tensor, teacher_logits: torch.Tensor, aligned: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_terms of logits already aligned with their targets (any leading shape)."""
        counted = aligned != self.ignore_index
        ce = F.cross_entropy(logits.float().flatten(0, -2), aligned.flatten(), ignore_index=self.ignore_index,
                             reduction="none").view(aligned.shape)
        shared = min(logits.shape[-1], teacher_logits.shape[-1])
        student = F.log_softmax(logits[..., :shared].float() / self.temperature, dim=-1)
        teacher = F.log_softmax(teacher_logits[..., :shared].float() / self.temperature, dim=-1)
        first, second = (teacher, student) if self.divergence == "forward" else (student, teacher)
        kl = (first.exp() * (first - second)).sum(-1)
        return ce, torch.where(counted, kl, torch.zeros_like(kl))

    def _metrics_of_terms(self, ce: torch.Tensor, kl: torch.Tensor, correct: torch.Tensor, aligned: torch.Tensor
                          ) -> dict[str, PerSample]:
        found = self._per_sample(self.mixed(ce, kl), correct, aligned)
        weight = found["loss"][1]
        dims = tuple(range(1, ce.dim()))
        return {**found, "ce": (ce.sum(dims), weight), "kl": (kl.sum(dims), weight)}

    # objective.chunk_tokens: both terms through the student's output layer a chunk at a time ---------------------
    # (src/objectives/chunked.py). The layer gets the targets with the teacher's rows; in training it returns the
    # sums (mixed loss, cross-entropy, KL), in evaluation each aligned target's (cross-entropy, KL, likeliest is it).

    @property
    def cross_entropy(self) -> CrossEntropy:
        """The data's term alone: what chunk_tokens' first-batch check compares the chunked loss with."""
        plain = CausalLM if self.shifts_targets else CrossEntropy
        return plain(ignore_index=self.ignore_index, chunk_tokens=self.chunk_tokens, target_key=self.target_key)

    def output_layer_targets(self, inputs: Mapping, targets: torch.Tensor) -> tuple:
        """The targets, the teacher's rows (its last hidden states, or its logits) and its output layer's (weight,
        bias) where the rows are hidden states."""
        if "teacher_hidden" in inputs:
            return targets, inputs["teacher_hidden"], *inputs["teacher_head"]
        return targets, inputs["teacher_logits"], None, None

    def chunked_loss_sum(self, hidden, weight, bias, targets_and_teacher) -> torch.Tensor:
        targets, teacher, teacher_weight, teacher_bias = targets_and_teacher
        total = hidden.new_zeros(3, dtype=torch.float32)
        for chunk in self._chunks(hidden, targets, teacher)[1]:
            total = total + checkpoint(self._sums_of_chunk, *chunk, weight, bias, teacher_weight, teacher_bias,
                                       use_reentrant=False)
        return total

    def chunked_token_scores(self, hidden, weight, bias, targets_and_teacher) -> torch.Tensor:
        targets, teacher, teacher_weight, teacher_bias = targets_and_teacher
        shape, chunks = self._chunks(hidden, targets, teacher)
        scores = []
        for hidden_chunk, aligned, teacher_rows in chunks:
            logits = F.linear(hidden_chunk, weight, bias)
            ce, kl = self.terms(logits, _teacher_logits(teacher_rows, teacher_weight, teacher_bias), aligned)
            scores.append(torch.stack([ce, kl, (logits.argmax(-1) == aligned).float()], dim=-1))
        return torch.cat(scores).view(*shape, 3)

    def loss_sum_from_output_layer(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor
                                   ) -> torch.Tensor:
        sums = call_model(model, inputs["student"])
        if self._sums is not None:
            self._sums = self._sums + sums[1:].detach()
        return sums[0]

    def metrics_from_output_layer(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor
                                  ) -> dict[str, PerSample]:
        ce, kl, correct = call_model(model, inputs["student"]).unbind(-1)
        _, aligned = self.aligned(targets, targets)
        return self._metrics_of_terms(ce, kl, correct.bool(), aligned)

    def _chunks(self, hidden: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor
                ) -> tuple[torch.Size, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """The aligned targets' shape, and (hidden states, targets, teacher's rows) as rows, chunk_tokens each."""
        hidden, aligned = self.aligned(hidden, targets)
        teacher, _ = self.aligned(teacher, targets)
        rows = (hidden.reshape(-1, hidden.shape[-1]), aligned.reshape(-1), teacher.reshape(-1, teacher.shape[-1]))
        size = self.chunk_tokens
        return aligned.shape, [tuple(t[start:start + size] for t in rows) for start in range(0, rows[1].numel(), size)]

    def _sums_of_chunk(self, hidden, targets, teacher_rows, weight, bias, teacher_weight, teacher_bias
                       ) -> torch.Tensor:
        teacher_logits = _teacher_logits(teacher_rows, teacher_weight, teacher_bias)
        ce, kl = self.terms(F.linear(hidden, weight, bias), teacher_logits, targets)
        return torch.stack([self.mixed(ce, kl).sum(), ce.sum(), kl.sum()])

    # The teacher -------------------------------------------------------------------------------------------------

    def load_teacher(self, accelerator, data, student: torch.nn.Module) -> None:
        """The teacher on this process's device, frozen, after its ids and its vocabulary are checked against the
        data's. Under FSDP it is sharded as the student is, and an export or a transformers folder is never held
        whole: every rank builds it without values and reads its own slices of the safetensors files once it is
        sharded (src/models/pretrained_slices.py); a checkpoint is read whole by each rank first. An export's
        config may name the student's own class, which this run's config named, besides config/'s."""
        from src.models.hub import MODEL_FILES, TOKENIZER_FILES, local_path

        key = f"objective.teacher={self.teacher_path}"
        folder = local_path(self.teacher_path, "objective.teacher", MODEL_FILES + TOKENIZER_FILES, quiet=True,
                            revision=self.teacher_revision)
        if not folder.is_dir():
            raise UsageError(f"{key}: no such folder; give an export (RUN/model), a checkpoint "
                             "(RUN/checkpoints/step_N), or a transformers folder or hub id")
        codec = getattr(data, "codec", None)
        if not check_same_ids(key, folder, codec, "the teacher reads", "Distil on data tokenized as the teacher's "
                              "(data.tokenizer=the teacher's folder; data.level)") and codec is not None:
            log.warning("%s: the folder says nothing of how its ids were made (no tokenizer, vocabulary.json or "
                        "data.json): they are taken to mean the data's tokens", key)
        trusted = {f"{type(student).__module__}.{type(student).__qualname__}"}
        teacher, slices = None, None
        if sharded(accelerator):
            teacher, slices, why = export_without_values(folder, trusted, "a student of the same class, {key}={value}")
            if slices is None and accelerator.is_main_process:
                log.info("objective=distill: each rank reads the teacher whole before it is sharded (%s)", why)
        if teacher is None:
            teacher = load_teacher_model(key, folder, trusted)
        if getattr(data, "attends_per_document", False):  # data.packing=true: the teacher reads packed rows too
            from src.data.packing import attend_per_document

            attend_per_document(teacher)
        vocab_size = data.sizes().get("vocab_size")
        width = output_width(teacher)
        if vocab_size is not None and width is not None and width < vocab_size:
            raise UsageError(f"{key}: the teacher scores {width} token ids, but the data has {vocab_size}")
        parameters = sum(p.numel() for p in teacher.parameters())
        teacher.requires_grad_(False).eval()
        if self.teacher_dtype is not None:
            teacher.to(self.teacher_dtype)
        if sharded(accelerator):  # FSDP: sharded as the student is (accelerate's wrapping), each rank its part
            self.teacher = shard_frozen(accelerator, teacher, slices)
            held = "sharded over the processes" + (", each rank read its own slices" if slices is not None else "")
        else:
            self.teacher, held = teacher.to(accelerator.device), "one copy per process"
        self.accelerator = accelerator
        if accelerator.is_main_process:
            dtype = str(next(teacher.parameters()).dtype).replace("torch.", "")
            log.info("objective=distill: teacher %s (%s parameters in %s, frozen, %s), kd_ratio=%g, temperature=%g, %s "
                     "KL", folder, f"{parameters:,}", dtype, held, self.kd_ratio, self.temperature, self.divergence)


class CausalLMDistillation(CausalLM, Distillation):
    """Hugging Face's convention: `labels` aligned with `input_ids`, shifted here (data=jsonl, hf_dataset, stream;
    a transformers student), as objective=causal_lm."""


def load_teacher_model(key: str, folder: Path, trusted: set[str]) -> torch.nn.Module:
    """An export or a transformers folder (load_exported_model, as eval.py tells them), else a checkpoint (rebuilt
    from its run's config)."""
    from src.checkpointing.export import load_exported_model
    from src.checkpointing.for_eval import load_checkpointed_model, run_config_for

    try:
        if (folder / "config.json").is_file() or (folder / "config.yaml").is_file():
            return load_exported_model(folder, trusted=trusted, accept="a student of the same class, {key}={value}")
        return load_checkpointed_model(folder, run_config_for(folder, trusted))
    except FileNotFoundError as error:
        raise UsageError(f"{key}: {error}") from None


def _teacher_logits(rows: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]
                    ) -> torch.Tensor:
    """A chunk's teacher logits: its rows are the logits, or its last hidden states where its output layer is given
    (no gradient flows to the teacher: its weights and hidden states were made without one)."""
    return rows if weight is None else F.linear(rows, weight, bias)

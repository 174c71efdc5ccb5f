"""Evaluate an exported model or a checkpoint on the validation split of the data it was trained on.

    python eval.py path=outputs/RUN/model                  # or outputs/RUN/model_best
    accelerate launch --multi_gpu --num_processes 2 eval.py path=outputs/RUN/checkpoints/step_00000500

Prints the metrics and writes them as JSON (main process only). Exact on any number of processes.
"""

import json
import logging
from pathlib import Path

import hydra
from accelerate import Accelerator
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import src.launch.hydra_hooks  # noqa: F401  (registers the resolvers a run's config may use)
from src.checkpointing.export import load_exported_model
from src.checkpointing.for_eval import load_checkpointed_model, run_config_for
from src.data.packing import attend_per_document
from src.data.tokenizer import BUILT_IN_TOKENIZERS
from src.launch.accelerator import keep_freed_memory, use_cpu_threads
from src.launch.checks import check_process_count
from src.launch.settings import needs_cpu_flag
from src.launch.shutdown import run_then_release, shut_down
from src.loop.evaluation import evaluate
from src.loop.forward import Forward
from src.models.hub import fetch_from_hub
from src.objectives.reference import for_evaluation as reference_for_evaluation
from src.schema.trusted import trusted_by

log = logging.getLogger("eval")


@hydra.main(config_path="config", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    source = Path(cfg.path)
    trusted = trusted_by(cfg)  # a callable the run's config names beyond config/'s: +model._target_=NAME
    run_cfg = run_config_for(source, trusted)
    accelerator = Accelerator(cpu=needs_cpu_flag(), mixed_precision=cfg.mixed_precision)
    check_process_count(accelerator)
    use_cpu_threads(accelerator, None)
    keep_freed_memory(accelerator.device)  # each batch's activations reused, not faulted in again

    fetch_from_hub(accelerator, run_cfg.model, run_cfg.data, BUILT_IN_TOKENIZERS)  # at the run's revision
    data = instantiate(OmegaConf.merge(run_cfg.data, cfg.data), _convert_="all")
    objective = instantiate(run_cfg.objective, _convert_="all")
    if (source / "model.safetensors").is_file() and (source / "config.yaml").is_file():
        model = load_exported_model(source, trusted=trusted, accept="+model._target_={value}")
    else:
        model = load_checkpointed_model(source, run_cfg)  # the run's config holds the data-derived sizes
    if data.attends_per_document:  # data.packing=true
        attend_per_document(model)
    model = accelerator.prepare_model(model, evaluation_mode=True)
    val_loader = accelerator.prepare_data_loader(data.val_dataloader(cfg.eval_batches))

    prompts = getattr(objective, "trains_on_prompts", False)  # objective=grpo, whose evaluation reads no reference
    if getattr(objective, "reference_kind", None) and not prompts:  # objective=dpo: the run's reference model
        objective.reference = reference_for_evaluation(accelerator, run_cfg, source, objective)
    if getattr(objective, "teacher_path", None):  # objective=distill: the teacher the run distilled from
        objective.load_teacher(accelerator, data, accelerator.unwrap_model(model))
    if prompts:  # objective=grpo: the prompts' rows, the reward model
        objective.start(accelerator, model, data, None, None)
    forward = Forward(objective, compile=False)
    metrics = {f"eval/{k}": v for k, v in evaluate(model, val_loader, accelerator, forward).items()}
    if accelerator.is_main_process:
        output = Path(cfg.output) if cfg.output else source / "eval_metrics.json"
        report = {"path": str(source), "num_processes": accelerator.num_processes, **metrics}
        output.write_text(json.dumps(report, indent=2) + "\n")
        log.info("%s\nwritten to %s", json.dumps(report, indent=2), output)
    shut_down(accelerator)


if __name__ == "__main__":
    run_then_release(main)

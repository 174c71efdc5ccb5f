"""The features users expect of a serious trainer, each a config key: EMA weights, early stopping,
SyncBatchNorm, training length in epochs, LR scaling by global batch, deterministic runs, a CUDA memory cap,
starting from another run's weights, an evaluation before the first step."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import (
    EVAL_BOUND,
    QUIET,
    ROOT,
    TINY_GPT,
    banner_row,
    exported_weights,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
)

SHORT = [*TINY_GPT, *QUIET, "data.batch_size=8", "trainer.monitor=null"]


def test_ema_weights_are_evaluated_exported_and_resume_bitwise(tmp_path):
    # A constant schedule: extending max_steps on resume then changes nothing else.
    ema = [*SHORT, "trainer.ema_decay=0.8", "scheduler=constant", "optimizer.lr=1e-2", "trainer.eval_every=4",
           "trainer.eval_batches=2", "trainer.checkpoint_every=4"]
    run([*ema, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'straight'}"])
    run([*ema, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'resumed'}"])
    proc = run([*ema, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={tmp_path / 'resumed'}"])
    assert "resumed from" in proc.stdout

    straight, resumed = (load_file(tmp_path / name / "model_ema" / "model.safetensors") for name in ("straight", "resumed"))
    assert max_abs_diff(straight, resumed) == 0.0
    assert max_abs_diff(straight, exported_weights(tmp_path / "straight")) > 0  # an average, not the last weights
    assert sorted(scalars(tmp_path / "straight", "eval_ema/loss")) == [4, 8]
    assert scalars(tmp_path / "straight", "eval_ema/loss") == scalars(tmp_path / "resumed", "eval_ema/loss")
    assert scalars(tmp_path / "straight", "eval_ema/loss") != scalars(tmp_path / "straight", "eval/loss")


def test_eval_on_start_logs_the_untrained_models_metrics_at_step_0_and_changes_nothing_trained(tmp_path):
    args = [*SHORT, "trainer.max_steps=3", "trainer.ema_decay=0.9", "trainer.eval_batches=2"]
    proc = run([*args, "trainer.eval_on_start=true", f"hydra.run.dir={tmp_path / 'start'}"])
    run([*args, f"hydra.run.dir={tmp_path / 'plain'}"])
    start, plain = tmp_path / "start", tmp_path / "plain"
    losses = scalars(start, "eval/loss")
    assert sorted(losses) == [0, 3] and sorted(scalars(plain, "eval/loss")) == [3]
    assert abs(losses[0] - math.log(65)) < 0.2  # the tiny GPT as initialised: about ln(vocabulary)
    assert scalars(start, "eval_ema/loss")[0] == losses[0]  # the average starts as the weights
    assert re.search(r"step 0: eval/loss=\d\.\d{4}, eval/accuracy=", proc.stdout)  # the metrics, as logged
    assert scalars(start, "train/loss") == scalars(plain, "train/loss")
    assert max_abs_diff(exported_weights(start), exported_weights(plain)) == 0
    assert scalars(start, "eval/loss")[3] == scalars(plain, "eval/loss")[3]
    resumed = run([*args, "trainer.eval_on_start=true", "trainer.max_steps=4", "resume=auto",
                   f"hydra.run.dir={start}"])
    assert "resumed from" in resumed.stdout and "step 0: eval/loss" not in resumed.stdout


def test_early_stopping_stops_every_rank_together_says_why_and_stays_stopped_on_resume(tmp_path):
    # min_delta larger than any change: only the first evaluation counts as an improvement.
    stop = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.max_steps=40", "trainer.eval_every=2",
            "trainer.eval_batches=2", "trainer.early_stopping_patience=2", "trainer.early_stopping_min_delta=100",
            f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run(stop, nproc=2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6
    named(summary["stopped"], "early stopping", "eval/loss", "trainer.early_stopping_patience=2")
    assert (tmp_path / "run" / "checkpoints" / "step_00000006").is_dir()
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()  # it finished: the model is exported
    assert "stopped at step 6 of 40" in proc.stdout

    again = run([*stop, "resume=auto"], nproc=2)
    assert "nothing left to train" in again.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6


def test_early_stopping_needs_a_monitored_metric_and_evaluations(tmp_path):
    for args, needed in ((["trainer.monitor=null"], "trainer.monitor"), (["trainer.eval_every=0"], "trainer.eval_every")):
        proc = run(["trainer.early_stopping_patience=3", *args, f"hydra.run.dir={tmp_path / 'r'}"], check=False)
        refused(proc, "trainer.early_stopping_patience", needed)
        assert not (tmp_path / "r").exists()


def test_sync_batchnorm_gives_two_processes_the_statistics_of_one_on_the_same_global_batch(tmp_path, cifar_root):
    resnet = ["experiment=cifar10_resnet", f"data.root={cifar_root}", "model.width=4", "data.num_workers=0",
              "trainer.max_steps=3", *QUIET, "trainer.checkpoint_every=0", "trainer.monitor=null",
              "optimizer.lr=0.05", "scheduler.warmup_steps=1"]
    run([*resnet, "data.batch_size=16", f"hydra.run.dir={tmp_path / 'one'}"])
    for name, flag in (("synced", "true"), ("unsynced", "false")):
        run([*resnet, "data.batch_size=8", f"trainer.sync_batchnorm={flag}", f"hydra.run.dir={tmp_path / name}"],
            nproc=2)
    one, synced, unsynced = (exported_weights(tmp_path / name) for name in ("one", "synced", "unsynced"))
    statistics = [key for key in one if key.endswith(("running_mean", "running_var"))]
    assert statistics
    assert max_abs_diff({k: one[k] for k in statistics}, {k: synced[k] for k in statistics}) <= 1e-5
    assert max_abs_diff(one, synced) <= 1e-5  # and the gradients through the statistics: the same weights
    # Without it each process normalises with its own half: the statistics differ (what the option fixes).
    assert max_abs_diff({k: one[k] for k in statistics}, {k: unsynced[k] for k in statistics}) > 1e-4


def test_max_epochs_trains_whole_epochs_and_the_schedule_ends_with_them(tmp_path):
    # 1% of tiny Shakespeare trains: 348 windows of 32 tokens, 43 whole batches of 8 per epoch.
    proc = run([*SHORT, "data.val_fraction=0.99", "trainer.max_epochs=2", "scheduler.warmup_steps=2",
                "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / 'run'}"])
    named(proc.stdout, "trainer.max_epochs=2: 86 optimizer steps")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 86
    lr = scalars(tmp_path / "run", "train/lr")
    assert sorted(lr)[-1] == 86 and abs(lr[86] - 1e-3 * 0.1) < 1e-9  # the cosine reaches min_lr_ratio at the end


def test_max_steps_and_max_epochs_together_are_refused(tmp_path):
    proc = run(["trainer.max_epochs=2", "trainer.max_steps=100", f"hydra.run.dir={tmp_path / 'r'}"], check=False)
    refused(proc, "trainer.max_epochs", "trainer.max_steps=null")
    assert not (tmp_path / "r").exists()


def test_scale_lr_scales_the_learning_rate_by_the_global_batch_and_logs_it(tmp_path):
    proc = run([*SHORT, "trainer.max_steps=2", "scheduler=constant", "optimizer.lr=1e-3", "optimizer.scale_lr=sqrt",
                "optimizer.reference_batch=2", "trainer.gradient_accumulation_steps=2",
                "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / 'run'}"])
    # global batch 8 x 2 = 16 samples, reference 2: sqrt(8) x 1e-3
    named(proc.stdout, "optimizer.scale_lr=sqrt", "global batch 16", "reference 2")
    assert abs(scalars(tmp_path / "run", "train/lr")[2] - 8**0.5 * 1e-3) < 1e-9
    refused(run(["optimizer.scale_lr=linear", f"hydra.run.dir={tmp_path / 'r'}"], check=False),
            "optimizer.scale_lr=linear", "optimizer.reference_batch")


def test_deterministic_runs_with_dropout_give_bitwise_equal_weights(tmp_path):
    for name in ("first", "second"):
        run([*SHORT, "trainer.max_steps=4", "model.dropout=0.1", "trainer.deterministic=true",
             "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / name}"])
    assert max_abs_diff(exported_weights(tmp_path / "first"), exported_weights(tmp_path / "second")) == 0.0
    # CPU runs repeat bitwise without the switch too: check that it took effect.
    assert re.search(r"deterministic kernels\s+: True", (tmp_path / "first" / "train.log").read_text())


def test_cuda_memory_fraction_is_ignored_with_a_notice_on_cpu(tmp_path):
    proc = run([*SHORT, "trainer.max_steps=1", "trainer.cuda_memory_fraction=0.5", "trainer.checkpoint_every=0",
                f"hydra.run.dir={tmp_path / 'run'}"])
    named(proc.stdout, "trainer.cuda_memory_fraction=0.5 ignored")


# --- debug modes (config/debug/) -----------------------------------------------------------------------


def test_debug_fast_dev_run_trains_evaluates_checkpoints_exports_and_resumes(tmp_path):
    dev = [*TINY_GPT, "debug=fast_dev_run", f"hydra.run.dir={tmp_path / 'dev'}"]
    run(dev)
    assert sorted(p.name for p in (tmp_path / "dev" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert sorted(scalars(tmp_path / "dev", "eval/loss")) == [2, 4]
    assert (tmp_path / "dev" / "model" / "model.safetensors").is_file()
    first = scalars(tmp_path / "dev", "train/loss")
    shutil.rmtree(tmp_path / "dev" / "checkpoints" / "step_00000004")  # as if killed after step 2's checkpoint
    proc = run([*dev, "resume=auto"])
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout
    assert scalars(tmp_path / "dev", "train/loss") == first  # steps 3 and 4 again, exactly


def test_debug_overfit_trains_on_two_batches_and_the_loss_falls_far(tmp_path):
    run([*TINY_GPT, "debug=overfit", "trainer.max_steps=150", "optimizer.lr=1e-2", "scheduler.warmup_steps=10",
         f"hydra.run.dir={tmp_path / 'run'}"])
    loss = scalars(tmp_path / "run", "train/loss")
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000150" / "train_state.json").read_text())
    assert (state["epoch"], state["samples_into_epoch"]) == (74, 2 * 32)  # an epoch is the 2 global batches
    assert loss[150] < 0.5 * loss[10], loss


def test_debug_limit_bounds_the_epoch_and_the_evaluation(tmp_path):
    run([*(a for a in SHORT if a != EVAL_BOUND), "debug=limit", "trainer.max_steps=25", "trainer.checkpoint_every=0",
         f"hydra.run.dir={tmp_path / 'run'}"])  # debug=limit's own bound on the evaluation, not the tests' usual one
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000025" / "train_state.json").read_text())
    assert (state["epoch"], state["samples_into_epoch"]) == (2, 5 * 8)  # 10 batches of 8 per epoch
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_metrics"]["eval/samples"] == 5 * 8


def test_debug_profile_writes_a_trace(tmp_path):
    run([*TINY_GPT, "debug=profile", f"hydra.run.dir={tmp_path / 'run'}"])
    assert list((tmp_path / "run" / "profile").glob("*.pt.trace.json"))


# --- sweeps ------------------------------------------------------------------------------------------------


def test_a_multirun_sweep_gives_each_job_its_own_run_directory_and_settings(tmp_path):
    """In-process jobs: each its own directory, log and Accelerator settings (precision differs per job)."""
    from omegaconf import OmegaConf

    run(["-m", *SHORT, "trainer.max_steps=3", "trainer.checkpoint_every=0", "trainer.mixed_precision=no,bf16",
         "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    jobs = sorted((tmp_path / "sweep").iterdir(), key=lambda p: p.name)
    assert [p.name for p in jobs if p.is_dir()] == ["0", "1", "2", "3"]
    seen = set()
    for job in jobs:
        if not job.is_dir():
            continue
        cfg = OmegaConf.load(job / "config.yaml")
        seen.add((cfg.trainer.mixed_precision, cfg.optimizer.lr))
        summary = json.loads((job / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["mixed_precision"] == cfg.trainer.mixed_precision
        assert (job / "model" / "model.safetensors").is_file()
        assert (job / "train.log").read_text().count("global batch size") == 1  # its own banner only
    assert seen == {("no", 1e-3), ("no", 3e-3), ("bf16", 1e-3), ("bf16", 3e-3)}


def test_optuna_search_runs_its_trials_and_reports_the_best_monitored_value(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="optional: pip install -r requirements-extras.txt")
    import yaml

    sweep = tmp_path / "sweep"
    run(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.n_startup_trials=2",
         *TINY_GPT, *QUIET, "data.batch_size=8", "trainer.max_steps=3", "trainer.eval_batches=2",
         "trainer.checkpoint_every=0", f"hydra.sweep.dir={sweep}"])
    trials = [json.loads((job / "summary.json").read_text()) for job in sorted(sweep.iterdir()) if job.is_dir()]
    assert len(trials) == 3
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"optimizer.lr", "optimizer.weight_decay"}
    assert results["best_value"] == min(trial["best"]["value"] for trial in trials)  # what train.py returned


def test_a_slurm_sweep_with_several_tasks_per_node_is_refused_before_anything_is_submitted(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional: pip install -r requirements-extras.txt")
    proc = run(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2", "optimizer.lr=1e-3,3e-3",
                f"hydra.sweep.dir={tmp_path / 'sweep'}"], check=False)
    refused(proc, "hydra.launcher.tasks_per_node=2", "PROCS_PER_NODE")
    assert not (tmp_path / "sweep").exists()


# --- trackers ----------------------------------------------------------------------------------------------


def wandb_offline_records(run_file):
    """The records of an offline W&B run file (what `wandb sync` would upload): LevelDB's log format, a
    7-byte file header, then chunks of [crc32 (4), length (2), type (1)] in 32 KiB blocks."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, record = run_file.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:
            break
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            yield wandb_internal_pb2.Record.FromString(record)
            record = b""


@pytest.mark.slow  # optional trackers: the default suite keeps TensorBoard's tests
def test_mlflow_and_wandb_log_offline_from_one_rank_and_a_resumed_run_continues_the_same_runs(tmp_path):
    pytest.importorskip("mlflow", reason="optional: pip install -r requirements-extras.txt")
    pytest.importorskip("wandb", reason="optional: pip install -r requirements-extras.txt")
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a local database: no server, no network
    env = {"MLFLOW_TRACKING_URI": store, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           **{f"WANDB_{k}_DIR": str(tmp_path / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    args = [*SHORT, "trainer.trackers=[tensorboard,mlflow,wandb]", "trainer.tracker_project=tests",
            "trainer.checkpoint_every=2", f"hydra.run.dir={tmp_path / 'run'}"]
    run([*args, "trainer.max_steps=2"], nproc=2, env=env)
    run([*args, "trainer.max_steps=4", "resume=auto"], nproc=2, env=env)
    tensorboard = scalars(tmp_path / "run", "train/loss")
    assert sorted(tensorboard) == [1, 2, 3, 4]

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # one run for two ranks and two launches
    assert runs[0].info.run_name == "run" and runs[0].data.params["data.batch_size"] == "8"
    losses = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    assert losses == tensorboard

    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    launches = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in launches] == [run_id, run_id]  # one run, from rank 0 only
    losses, params = {}, {}
    for launch in launches:
        for record in wandb_offline_records(launch / f"run-{run_id}.wandb"):
            if record.HasField("history"):
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                if "train/loss" in items:
                    losses[record.history.step.num] = items["train/loss"]
            elif record.HasField("config"):
                params.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif record.HasField("run"):
                assert record.run.project == "tests" and record.run.display_name == "run"
    assert losses == pytest.approx(tensorboard, rel=1e-6) and params["data.batch_size"] == 8


# A run to start others from: far enough trained that its weights are told apart from a fresh model's by the loss.
FROM_SCRATCH = [*TINY_GPT, *QUIET, "scheduler.warmup_steps=2", "optimizer.lr=1e-2"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run([*FROM_SCRATCH, "trainer.max_steps=30", f"hydra.run.dir={run_dir}"])
    return run_dir


def test_init_weights_starts_a_new_run_from_another_runs_export_or_checkpoint_and_a_resume_from_its_own(
        tmp_path, trained_run):
    source = Path(shutil.copytree(trained_run / "model", tmp_path / "source"))
    checkpoint = sorted((trained_run / "checkpoints").glob("step_*"))[-1]
    for name, weights in (("from_export", source), ("from_checkpoint", checkpoint)):
        proc = run([*FROM_SCRATCH, "trainer.max_steps=4", f"trainer.init_weights={weights}",
                    f"hydra.run.dir={tmp_path / name}"])
        assert banner_row(proc.stdout, "model") == f"src.models.gpt.GPT (started from the weights of {weights})"
    trained, started = scalars(trained_run, "train/loss"), scalars(tmp_path / "from_export", "train/loss")
    assert repr(started) == repr(scalars(tmp_path / "from_checkpoint", "train/loss"))  # the same weights
    assert started[1] < trained[1] - 0.5 and abs(started[1] - trained[30]) < 0.2  # where the trained run ended
    shutil.rmtree(source)  # a resumed run continues from its own checkpoint and reads the source no more
    run([*FROM_SCRATCH, "trainer.max_steps=6", f"trainer.init_weights={source}", "resume=auto",
         f"hydra.run.dir={tmp_path / 'from_export'}"])
    assert sorted(scalars(tmp_path / "from_export", "train/loss")) == list(range(1, 7))


@pytest.mark.parametrize("case, names", [  # besides trainer.init_weights=PATH itself
    ("another model", ["blocks.2."]),  # a tensor the saved weights lack
    ("another vocabulary", ["data.tokenizer", "data.level"]),  # the keys that tokenize as that run did
    ("not a model folder", ["model.safetensors", "RUN/model"]),
    ("a truncated file", ["model.safetensors"]),
])
def test_init_weights_that_cannot_serve_this_run_are_refused_before_training(tmp_path, trained_run, case, names):
    other_text = tmp_path / "other.txt"  # 65 characters like tiny Shakespeare's, a digit in place of its '3'
    other_text.write_text("".join(sorted(set((ROOT / "data" / "tinyshakespeare.txt").read_text()) - {"3"})) * 1000
                          + "0")
    truncated = Path(shutil.copytree(trained_run / "model", tmp_path / "truncated"))
    (truncated / "model.safetensors").write_bytes((truncated / "model.safetensors").read_bytes()[:1000])
    args = {"another model": ["model.n_layer=3", f"trainer.init_weights={trained_run / 'model'}"],
            "a truncated file": [f"trainer.init_weights={truncated}"],
            "another vocabulary": [f"data.path={other_text}", f"trainer.init_weights={trained_run / 'model'}"],
            "not a model folder": [f"trainer.init_weights={trained_run}"]}[case]
    proc = run([*FROM_SCRATCH, "trainer.max_steps=2", *args, f"hydra.run.dir={tmp_path / 'run'}"], check=False)
    refused(proc, args[-1], *names)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_init_weights_from_a_checkpoint_of_prompted_data_is_refused_on_characters_that_fit_but_mean_others(tmp_path):
    """data=jsonl's fingerprint has no `vocabulary`, only `ids made by`: a checkpoint's data.json must be read by it,
    or a character set of the same size (so the same embedding) but other characters trains on shifted ids."""
    speeches = (ROOT / "data" / "shakespeare_speeches.jsonl").read_text()
    other = tmp_path / "other.jsonl"
    other.write_text(speeches.replace("Q", "#"))  # 63 characters either way, from '#' on each id another
    jsonl = [*FROM_SCRATCH, "data=jsonl", "data.tokenizer=char", "objective=causal_lm", "trainer.max_steps=2"]
    run([*jsonl, f"data.path={ROOT / 'data' / 'shakespeare_speeches.jsonl'}", f"hydra.run.dir={tmp_path / 'a'}"])
    checkpoint = next((tmp_path / "a" / "checkpoints").iterdir())
    proc = run([*jsonl, f"data.path={other}", f"trainer.init_weights={checkpoint}", f"hydra.run.dir={tmp_path / 'b'}"],
               check=False)
    refused(proc, f"trainer.init_weights={checkpoint}", "the 63 characters", "data.tokenizer")
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_a_checkpoint_from_before_ids_made_by_is_still_checked_by_its_text_vocabulary(tmp_path):
    from src.data.tokenizer import Codec, check_same_ids
    from src.errors import UsageError

    codec = Codec("char", "abd")
    (tmp_path / "data.json").write_text(json.dumps({"vocabulary": "abc"}))
    with pytest.raises(UsageError, match="another token"):
        check_same_ids("key", tmp_path, codec, "it reads", "", fingerprint={"vocabulary": "abd"})
    assert check_same_ids("key", tmp_path, codec, "it reads", "", fingerprint={"vocabulary": "abc"})
    assert not check_same_ids("key", tmp_path / "nothing", codec, "it reads", "", fingerprint={"vocabulary": "abc"})

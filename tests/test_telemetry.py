"""Live telemetry in the event file, a run summary consistent with it, and progress lines fit for a log."""

import json
import re
import sys

import pytest
import torch

from src.reporting.telemetry import GpuMonitor
from tests.conftest import QUIET, TINY_GPT, run, scalars

TELEMETRY_TAGS = ("train/step_time", "train/data_wait", "train/samples_per_second", "train/tokens_per_second",
                  "train/mfu", "memory/rss_gib")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("telemetry") / "run"
    proc = run([*TINY_GPT, *QUIET, "trainer.log_every=5", "trainer.max_steps=20", "data.batch_size=4",
                "trainer.gradient_accumulation_steps=2", "trainer.eval_every=10", "trainer.peak_tflops=1",
                "trainer.progress_interval_s=0.01", "trainer.eval_batches=5", "data.eval_batch_size=6",
                f"hydra.run.dir={run_dir}"], nproc=2)
    return run_dir, proc.stdout


def test_every_telemetry_tag_is_logged_at_every_logging_step(two_process_run):
    run_dir, _ = two_process_run
    for tag in TELEMETRY_TAGS:
        assert sorted(scalars(run_dir, tag)) == [5, 10, 15, 20], tag
    step_time, wait = scalars(run_dir, "train/step_time"), scalars(run_dir, "train/data_wait")
    assert all(t > 0 for t in step_time.values()) and all(0 <= w < 1 for w in wait.values())
    samples, tokens = scalars(run_dir, "train/samples_per_second"), scalars(run_dir, "train/tokens_per_second")
    for step in samples:  # global: 4 per process x 2 processes x 2 micro-steps, every sample 32 counted targets
        assert samples[step] == pytest.approx(16 / step_time[step], rel=1e-4)
        assert tokens[step] == pytest.approx(32 * samples[step], rel=1e-3)


def test_summary_json_is_complete_and_agrees_with_the_event_file(two_process_run):
    run_dir, stdout = two_process_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "finished" and summary["steps"] == 20 and summary["processes"] == 2
    assert summary["mixed_precision"] == "no"
    assert summary["final_train_loss"] == pytest.approx(scalars(run_dir, "train/loss")[20], rel=1e-6)
    assert summary["final_metrics"]["eval/loss"] == pytest.approx(scalars(run_dir, "eval/loss")[20], rel=1e-6)
    assert summary["final_metrics"]["eval/samples"] == 30  # trainer.eval_batches x data.eval_batch_size
    assert summary["best"]["metric"] == "eval/loss" and summary["best"]["step"] in (10, 20)
    assert set(summary["time_s"]) == {"start-up", "training", "of which evaluation", "of which checkpointing",
                                      "of which data wait"}
    assert 0 < summary["time_s"]["start-up"] < summary["wall_time_s"]
    assert summary["time_s"]["of which evaluation"] < summary["time_s"]["training"] < summary["wall_time_s"]
    assert summary["tokens_per_second"] > 0 and 0 < summary["mfu"] < 1  # peak 1 TFLOP/s per process
    peaks = summary["peak_memory_gib"]["rss_per_rank"]
    assert len(peaks) == 2 and min(peaks) > 0.1 and summary["peak_memory_gib"]["rss_max_over_ranks"] == max(peaks)
    start_up = summary["peak_memory_gib"]["rss_per_rank_before_the_first_step"]  # the build, prepare and load
    assert len(start_up) == 2 and all(0.1 < before <= peak for before, peak in zip(start_up, peaks))
    assert stdout.count("run summary (") == 1  # printed once, by rank 0
    export = summary["export"]  # the final export, after the summary: its time and each rank's peak while it ran
    assert export["seconds"] >= 0 and len(export["peak_rss_gib_per_rank"]) == 2
    assert all(0.1 < peak for peak in export["peak_rss_gib_per_rank"])


def test_without_a_terminal_progress_is_plain_lines_with_step_loss_throughput_and_eta(two_process_run):
    _, stdout = two_process_run
    assert "\r" not in stdout
    lines = re.findall(r"step (\d+)/20 \(\d+%\) \| loss [\d.]+ \| [\d,]+ tokens/s \| elapsed [\d:]+ \| ETA [\d:]+",
                       stdout)
    assert lines and lines[-1] == "20"


def test_profile_writes_a_torch_profiler_trace_of_the_chosen_steps_into_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run([*TINY_GPT, *QUIET, "trainer.max_steps=6", "data.batch_size=4", "trainer.profile=[1,1,2]",
         f"hydra.run.dir={run_dir}"])
    traces = list((run_dir / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    assert any("ProfilerStep#" in event.get("name", "") for event in trace["traceEvents"])


def test_env_check_json_parses_and_names_torch_and_accelerate():
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "scripts/env_check.py", "--json"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    facts = json.loads(out)
    import accelerate
    import torch

    assert facts["torch"] == torch.__version__ and facts["accelerate"] == accelerate.__version__
    assert facts["cpu_cores"] >= 1 and facts["recommended"]["launch"].startswith("accelerate launch")


class StandInNvml:
    """NVML of an 8-GPU node, answering with the index it is asked about (NVML does not run here). NVML numbers
    every GPU of the node and ignores CUDA_VISIBLE_DEVICES."""

    class NVMLError_DriverNotLoaded(Exception):
        pass

    NVML_TEMPERATURE_GPU = 0

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 8

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, index):
        return type("Rates", (), {"gpu": 10 + index, "memory": 0})()

    def nvmlDeviceGetMemoryInfo(self, index):
        return type("Memory", (), {"used": index * 2**30})()

    def nvmlDeviceGetTemperature(self, index, sensor):
        return 40 + index

    def nvmlDeviceGetPowerUsage(self, index):
        return 1000 * (100 + index)


def test_gpu_scalars_are_the_gpus_this_job_sees_numbered_as_cuda_numbers_them(monkeypatch):
    """A job given GPUs 4 and 5 of a shared node logs them as gpu/0 and gpu/1 (cuda:0, cuda:1), and no other
    job's GPU; only the main process, which logs, reads them."""
    nvml = StandInNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "pynvml", nvml, raising=False)
    monkeypatch.setattr(torch.cuda, "_HAS_PYNVML", True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # what CUDA says under CUDA_VISIBLE_DEVICES=4,5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")

    assert GpuMonitor(torch.device("cuda", 0)).scalars() == {
        "gpu/0/utilization": 14.0, "gpu/0/memory_used_gib": 4.0, "gpu/0/temperature_c": 44.0, "gpu/0/power_w": 104.0,
        "gpu/1/utilization": 15.0, "gpu/1/memory_used_gib": 5.0, "gpu/1/temperature_c": 45.0, "gpu/1/power_w": 105.0,
    }
    assert GpuMonitor(torch.device("cuda", 1), is_main_process=False).scalars() == {}
    assert GpuMonitor(torch.device("cpu")).scalars() == {}


def _events_file(directory, purge_step: int, steps: range, name: str):
    """A launch's TensorBoard file as the template's writer opens it (purge_step, then train/loss per step),
    renamed to `name` (the second it was opened and the pid are what its name sorts by)."""
    from torch.utils.tensorboard import SummaryWriter

    opened = directory / "opened"
    writer = SummaryWriter(str(opened), purge_step=purge_step)
    for step in steps:
        writer.add_scalar("train/loss", float(purge_step * 1000 + step), step)
    writer.close()
    (file,) = opened.iterdir()
    file.rename(directory / name)
    opened.rmdir()


@pytest.mark.parametrize("resumed_second, whole", [(1795963996, False), (1795963997, True)],
                         ids=["same_second", "a_second_later"])
def test_tensorboard_reads_a_resumed_launchs_file_after_the_killed_ones_only_if_opened_a_second_later(
        tmp_path, resumed_second, whole):
    """Why a launch opens its event file in a later second than the files there (run_log's
    open_after_the_last_event_file): a run killed at step 10 and resumed from step 4 within the same second,
    its pids 9876 then 10234, sorts the resumed file first (pid as text), so the killed launch's purge from step 1
    drops what the resumed one logged. A second later, the curve is the resumed run's from step 5 on."""
    from tests.conftest import scalars

    log_dir = tmp_path / "run" / "tensorboard"
    log_dir.mkdir(parents=True)
    _events_file(log_dir, 1, range(1, 11), "events.out.tfevents.1795963996.host.9876.0")  # killed at step 10
    _events_file(log_dir, 5, range(5, 13), f"events.out.tfevents.{resumed_second}.host.10234.0")  # resumed at 4
    expected = {step: float((1 if step < 5 else 5) * 1000 + step) for step in range(1, 13)}
    assert (scalars(tmp_path / "run", "train/loss") == expected) == whole


def test_a_launch_opens_its_event_file_in_a_later_second_than_the_files_there(tmp_path):
    import time

    from src.reporting.run_log import open_after_the_last_event_file

    start = time.time()
    open_after_the_last_event_file(tmp_path)  # none there: no wait
    (tmp_path / f"events.out.tfevents.{int(start) - 5}.host.1.0").touch()
    open_after_the_last_event_file(tmp_path)  # opened seconds ago: no wait
    assert time.time() - start < 0.5
    now = int(time.time())
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / f"events.out.tfevents.{now}.host.a.b.99.0").touch()  # this second, a dotted host
    open_after_the_last_event_file(tmp_path)
    assert int(time.time()) > now

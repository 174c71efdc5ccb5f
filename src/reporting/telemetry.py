"""What training is doing, measured without slowing it: throughput, MFU, memory, GPU state, and a run summary.

Per step only host-side clocks are read and the step's target count is added on the device: no host sync.
At each logging step (every trainer.log_every optimizer steps) the interval's numbers are reduced across
ranks in one collective, next to the `.item()` logging already makes:

    train/step_time           seconds per optimizer step, the slowest rank's (stragglers show)
    train/data_wait           share of the step spent waiting for the next batch (this rank's, the worst)
    train/samples_per_second  global
    train/tokens_per_second   global, counted targets only (padding and -100 labels excluded)
    train/mfu                 model FLOPs utilisation, when the model states its FLOPs per token and the
                              device's peak is known (table below, or trainer.peak_tflops)
    memory/rss_gib, memory/cuda_allocated_gib, memory/cuda_reserved_gib, memory/cuda_peak_gib
    gpu/<i>/utilization, gpu/<i>/memory_used_gib, gpu/<i>/temperature_c, gpu/<i>/power_w  (NVML, if present)

With trainer.profile=[wait, warmup, active], rank 0 also records a torch.profiler trace of those optimizer
steps into <run_dir>/profile (TensorBoard's profiler plugin or https://ui.perfetto.dev open it).
"""

import contextlib
import json
import logging
import os
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from accelerate import Accelerator

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU (NVIDIA's data sheets, without sparsity), by autocast dtype. fp32 on Ampere and
# later counts TF32 tensor cores, which PyTorch uses for matmuls when allowed.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "no": 156.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "no": 494.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "no": 494.0},
}


def peak_tflops(device: torch.device, precision: str, override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((table[precision] for gpu, table in PEAK_TFLOPS.items() if gpu in name), None)


def flops_per_token(model: torch.nn.Module) -> Optional[float]:
    """Training FLOPs per token: the model's own statement, or 6 x parameters + attention for a transformers
    causal LM (the PaLM appendix's estimate, as nanoGPT's GPT.flops_per_token)."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token())
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "num_parameters"):
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if layers and width and context:
            return 6.0 * model.num_parameters(exclude_embeddings=True) + 12.0 * layers * width * context
    return None


_IMPORTED = time.time()


def process_start_time() -> float:
    """When this process started (Linux: from /proc, so interpreter start-up and imports count), else when this
    module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


def rss_gib() -> float:
    """Resident memory of this process now (Linux), else its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return peak_rss_gib()


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


@contextlib.contextmanager
def resident_peak() -> Iterator[dict]:
    """The peak resident memory of what the block does (GiB, in the yielded dict's "peak_gib"; absent where Linux
    cannot tell): the kernel's high-water mark, restarted at the block's start (/proc/self/clear_refs)."""
    found: dict = {}
    try:
        Path("/proc/self/clear_refs").write_text("5")
        measured = True
    except OSError:
        measured = False
    yield found
    if measured:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                found["peak_gib"] = int(line.split()[1]) / 2**20


class GpuMonitor:
    """Utilisation, memory, temperature and power of the GPUs this process sees, read where they are logged
    (the main process); nothing (and no noise) without NVML (nvidia-ml-py, a driver, permission).

    torch.cuda's NVML queries map cuda:<i> to its NVML index through CUDA_VISIBLE_DEVICES (indices or UUIDs), so
    gpu/<i> is cuda:<i>: a job given GPUs 4 and 5 of a shared node logs those two as gpu/0 and gpu/1, not the
    node's every GPU, other jobs' included, under NVML's own numbering."""

    READINGS = {  # name: (torch.cuda's query of cuda:<i>, its unit), looked up when read: a torch without one
                  # loses that reading alone
        "utilization": (lambda i: torch.cuda.utilization(i), 1),
        "memory_used_gib": (lambda i: torch.cuda.device_memory_used(i), 2**30),
        "temperature_c": (lambda i: torch.cuda.temperature(i), 1),
        "power_w": (lambda i: torch.cuda.power_draw(i), 1000),  # mW
    }

    def __init__(self, device: torch.device, is_main_process: bool = True):
        self.devices: list[int] = []
        if device.type != "cuda" or not is_main_process:
            return
        try:
            torch.cuda.utilization(0)
            self.devices = list(range(torch.cuda.device_count()))
        except Exception:  # no library, no driver, no permission: monitoring is optional
            self.devices = []

    def scalars(self) -> dict[str, float]:
        out = {}
        for i in self.devices:
            for name, (read, unit) in self.READINGS.items():
                with contextlib.suppress(Exception):  # a reading this GPU or driver does not offer
                    out[f"gpu/{i}/{name}"] = read(i) / unit
        return out


class Telemetry:
    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, samples_per_step: int, trainer: Any,
                 run_dir: Path):
        """`trainer`: the run's TrainerConfig (its mixed_precision, peak_tflops, profile and monitor)."""
        self.accelerator = accelerator
        self.precision, self.monitor = trainer.mixed_precision, trainer.monitor
        self.profiler = None
        if trainer.profile and accelerator.is_main_process:  # one trace, rank 0's: only rank 0 writes files
            wait, warmup, active = trainer.profile
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(run_dir / "profile")),
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if accelerator.device.type == "cuda" else []),
            )
        self.samples_per_step = samples_per_step  # global: batch x processes x accumulation
        self.flops_per_token = flops_per_token(model)
        peak = peak_tflops(accelerator.device, self.precision, trainer.peak_tflops)
        self.peak_flops = peak * 1e12 * accelerator.num_processes if peak else None
        self.gpus = GpuMonitor(accelerator.device, accelerator.is_main_process)
        self.process_started = process_start_time()
        self.phases: dict[str, float] = defaultdict(float)  # seconds per phase, over the whole run
        self.loop_started: Optional[float] = None
        self.start_up_peak_rss = 0.0  # GiB: the build, the prepare and the load, before the first step
        self._reset_interval()
        self.total_steps = 0
        self.total_targets = torch.zeros((), device=accelerator.device)  # global counts, summed on the device

    def _reset_interval(self) -> None:
        self.interval_started = time.perf_counter()
        self.interval_steps, self.interval_wait, self.interval_excluded = 0, 0.0, 0.0
        self.interval_targets = torch.zeros((), device=self.accelerator.device)

    def timed_windows(self, windows: Iterable) -> Iterator:
        """The windows, with the time spent waiting for each counted as data wait."""
        iterator = iter(windows)
        while True:
            started = time.perf_counter()
            if self.loop_started is None:
                self.loop_started = started
                self.phases["start-up"] = time.time() - self.process_started
                self.start_up_peak_rss = peak_rss_gib()
                self._reset_interval()
                if self.profiler is not None:
                    self.profiler.start()
            try:
                window = next(iterator)
            except StopIteration:
                return
            waited = time.perf_counter() - started
            self.interval_wait += waited
            self.phases["data wait"] += waited
            self.window_read = (started, waited)
            yield window

    def step_finished(self, counted_targets: torch.Tensor) -> None:
        """`counted_targets`: the step's global count of targets (src/loop/accumulation.py's global_target_count)."""
        self.interval_steps += 1
        self.total_steps += 1
        self.interval_targets += counted_targets.detach()  # stays on the device: no sync
        self.total_targets += counted_targets.detach()
        if self.profiler is not None:
            self.profiler.step()

    def step_dropped(self) -> None:
        """A step of trainer.skip_steps, its window read and dropped: neither step time nor data wait."""
        started, waited = self.window_read
        self.interval_wait -= waited
        self.phases["data wait"] -= waited
        self.interval_excluded += time.perf_counter() - started

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time spent outside optimizer steps (evaluation, checkpointing): not counted as step time."""
        started = time.perf_counter()
        yield
        spent = time.perf_counter() - started
        self.phases[name] += spent
        self.interval_excluded += spent

    def scalars(self) -> dict[str, float]:
        """The interval's telemetry, reduced over ranks (every rank must call it, at the same steps)."""
        elapsed = time.perf_counter() - self.interval_started - self.interval_excluded
        steps = max(self.interval_steps, 1)
        local = torch.tensor([elapsed / steps, self.interval_wait / max(elapsed, 1e-9)],
                             device=self.accelerator.device, dtype=torch.float64)
        slowest = self.accelerator.reduce(local, "max") if self.accelerator.num_processes > 1 else local
        step_time, data_wait = slowest.tolist()
        targets = self.interval_targets.item()  # already global: each step's count was all-reduced for the loss
        out = {"train/step_time": step_time, "train/data_wait": data_wait,
               "train/samples_per_second": self.samples_per_step / step_time,
               "train/tokens_per_second": targets / (step_time * steps)}
        mfu = self.mfu(out["train/tokens_per_second"])
        if mfu is not None:
            out["train/mfu"] = mfu
        out.update(self.memory())
        out.update(self.gpus.scalars())
        self._reset_interval()
        return out

    def mfu(self, tokens_per_second: float) -> Optional[float]:
        if self.flops_per_token is None or self.peak_flops is None:
            return None
        return self.flops_per_token * tokens_per_second / self.peak_flops

    def memory(self) -> dict[str, float]:
        out = {"memory/rss_gib": rss_gib()}
        if self.accelerator.device.type == "cuda":
            device = self.accelerator.device
            out["memory/cuda_allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
            out["memory/cuda_reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
            out["memory/cuda_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return out

    def summary(self, run_dir: Path, stopped: str, state: Any, final_metrics: dict[str, float],
                final_loss: Optional[float], data: Optional[dict[str, int]] = None) -> dict:
        """summary.json in the run dir and a printed table (main process); every rank calls it. `state`: the
        run's TrainState (its step and best trainer.monitor value); `data`: what the data module states of the
        data consumed (a mixture's tokens per source)."""
        if self.profiler is not None:
            self.profiler.stop()  # writes the trace if the run ended inside the active steps
            self.profiler = None
        wall = time.time() - self.process_started
        training = time.perf_counter() - self.loop_started if self.loop_started else 0.0
        throughput = self.total_targets.item() / training if training else 0.0
        # Every rank's: under FSDP rank 0 may hold more than the others (it builds the model whole, it gathers the
        # export), and a node's host memory is the sum over its ranks. Before the first step: what the start took.
        peak_rss, start_up_rss = self.accelerator.gather(
            torch.tensor([[peak_rss_gib(), self.start_up_peak_rss]], device=self.accelerator.device)).T.tolist()
        summary = {
            "stopped": stopped,
            "steps": state.step,
            "processes": self.accelerator.num_processes,
            "mixed_precision": self.precision,
            "wall_time_s": wall,
            "time_s": {"start-up": self.phases["start-up"], "training": training,
                       "of which evaluation": self.phases["evaluation"],
                       "of which checkpointing": self.phases["checkpointing"],
                       "of which data wait": self.phases["data wait"]},
            "samples_per_second": self.total_steps * self.samples_per_step / training if training else 0.0,
            "tokens_per_second": throughput,
            "mfu": self.mfu(throughput),
            "peak_memory_gib": {"rss_max_over_ranks": max(peak_rss), "rss_per_rank": peak_rss,
                                "rss_per_rank_before_the_first_step": start_up_rss,
                                **({"cuda": torch.cuda.max_memory_allocated() / 2**30}
                                   if self.accelerator.device.type == "cuda" else {})},
            "final_train_loss": final_loss,
            "final_metrics": final_metrics,
            "data": data or {},
            "best": {"metric": self.monitor, "value": state.best_metric, "step": state.best_step},
        }
        if self.accelerator.is_main_process:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            log.info("run summary (%s):\n%s", run_dir / "summary.json", summary_table(summary))
        return summary


def summary_table(summary: dict) -> str:
    rows = [("stopped", summary["stopped"]), ("steps", summary["steps"]), ("processes", summary["processes"]),
            ("mixed precision", summary["mixed_precision"]), ("wall time", f"{summary['wall_time_s']:.1f} s")]
    rows += [(f"  {name}", f"{seconds:.1f} s") for name, seconds in summary["time_s"].items()]
    rows += [("samples/s", f"{summary['samples_per_second']:.1f}"), ("tokens/s", f"{summary['tokens_per_second']:.0f}"),
             ("MFU", f"{summary['mfu']:.1%}" if summary["mfu"] is not None else "n/a (peak FLOPS unknown)"),
             ("peak RSS", f"{summary['peak_memory_gib']['rss_max_over_ranks']:.2f} GiB")]
    if "cuda" in summary["peak_memory_gib"]:
        rows.append(("peak CUDA memory", f"{summary['peak_memory_gib']['cuda']:.2f} GiB"))
    if summary["final_train_loss"] is not None:
        rows.append(("final train/loss", f"{summary['final_train_loss']:.4f}"))
    rows += [(name, f"{value:.4f}") for name, value in summary["final_metrics"].items()]
    rows += [(name, f"{value:,}") for name, value in summary.get("data", {}).items()]
    best = summary["best"]
    if best.get("metric"):
        rows.append((f"best {best['metric']}", f"{best['value']:.4f} at step {best['step']}"
                     if best["step"] is not None else "none (no finite value)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

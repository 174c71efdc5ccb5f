"""scripts/benchmark.py stays runnable: its figures are measured rarely (the GPU ones only when a GPU is lent),
so a change that breaks it must show here first, not on the day of the measurement."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from scripts.benchmarks.common import compose_config, in_turn
from scripts.benchmarks.parity import with_cpu_per_step
from tests.conftest import ROOT, run


def benchmark_report(args: list[str]) -> dict:
    """The JSON report a benchmark prints on stdout (its progress goes to stderr)."""
    proc = subprocess.run([sys.executable, "scripts/benchmark.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_in_turn_puts_each_side_first_in_every_other_pair():
    """parity, nanogpt and gpu compare two sides run one after the other: a side that always went first would
    always meet the machine as the previous pair left it (they said they alternated, and did not)."""
    order = []
    for repeat in range(4):
        in_turn(repeat, lambda: order.append("template"), lambda: order.append("reference"))
    assert [order[i] for i in range(0, 8, 2)] == ["template", "reference", "template", "reference"]
    assert sorted(order) == ["reference"] * 4 + ["template"] * 4


def test_cpu_time_per_step_leaves_out_start_up():
    """parity --cpu-time: a run of N steps minus a shorter one, so that what a process spends before its first step
    (imports, compiling) is not spread over the steps. Here a process spends 0.3 s starting and 4 ms a step."""
    def side(steps, _):
        burn = f"import time\nwhile time.process_time() < 0.3 + {steps} * 0.004: pass"
        subprocess.run([sys.executable, "-c", burn], check=True)
        return {}

    result = with_cpu_per_step(SimpleNamespace(cpu_time=True), side, 100, 20, None, None)
    assert result["cpu_ms_per_step"] == pytest.approx(4, rel=0.25), result


@pytest.mark.parametrize("overrides", [[], ["experiment=nanogpt_shakespeare_char"],
                                       ["experiment=owt_tokens", "data.path=train.bin", "data.vocab_size=50304"]])
def test_the_benchmarks_compose_the_configs_they_run(overrides):
    cfg = compose_config(overrides)
    assert cfg.model._target_ and cfg.trainer.max_steps > 0


@pytest.mark.slow
def test_the_parity_benchmarks_hand_written_loop_trains_the_templates_weights_bitwise():
    """Its step-time ratio means something only while the hand-written loop makes exactly train.py's arithmetic
    (with dropout on, so its random streams too: one per rank)."""
    proc = run(["parity", "model.dropout=0.1", "--repeats", "1", "--steps", "6", "--log-every", "2", "--processes",
                "1", "2"],
               command=[sys.executable, "scripts/benchmark.py"], timeout=600)
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict["1"]["weights_equal"] and verdict["2"]["weights_equal"], verdict


@pytest.mark.slow
@pytest.mark.parametrize("template_data", ["tokens", "shards"])
def test_the_gpu_benchmarks_template_side_runs_its_dry_run_on_cpu(template_data):
    """`gpu` is measured only on a day a GPU is lent: its dry run (CPU, a small model, no nanoGPT checkout, which
    CI has not) keeps the template's side runnable until then: the runs, their timing, the data wait and the
    first-step time, reading the tokens as one file or as the FineWeb recipe's prepared shards (then also with
    data.read_ahead=true)."""
    reading_ahead = ["--read-ahead"] if template_data == "shards" else []
    report = benchmark_report(["gpu", "--device", "cpu", "--mixed-precision", "no", "--model-shape", "1,2,32,64",
                               "--shapes", "2x2", "--modes", "eager", "--steps", "30",
                               "--template-data", template_data, *reading_ahead])
    entry = report["2x2 eager"]
    sides = ["template", *(["template, data.num_workers=0, data.read_ahead=true"] if reading_ahead else [])]
    assert list(entry) == sides, report
    assert report["template_first_step_s"]["eager"] > 0 and report["template_data"] == template_data, report
    for side in sides:
        assert entry[side]["ms_per_step"] > 0 and entry[side]["tokens_per_s"] > 0, report
        assert 0 <= entry[side]["data_wait_share"] < 1, report


@pytest.mark.slow
@pytest.mark.parametrize("command, measured", [
    (["startup", "--repeats", "1"], lambda r: r["python train.py: first step"]["median_s"]),
    (["checkpoint", "--repeats", "1", "--n-layer", "1", "--n-embd", "64"], lambda r: r["template_mb_per_s"]),
    (["stop-vote", "--repeats", "1", "--steps", "20", "--size", "64"],
     lambda r: r["async (the loop's)"]["ms_per_step"]),
    (["scale", "--sizes", "1x64", "--layouts", "ddp", "fsdp2", "--block-size", "32"],
     lambda r: len(r["1x64"]["fsdp2"]["peak_rss_gib_per_rank"]) == 2 and r["1x64"]["fsdp2_over_ddp_peak"]
     and len(r["1x64"]["fsdp2"]["export_peak_rss_gib_per_rank"]) == 2 and r["1x64"]["fsdp2"]["export_s"] >= 0),
    (["scale", "--objective", "grpo", "--sizes", "1x64", "--layouts", "fsdp2", "fsdp2_gather_off", "--block-size",
      "64", "--completion-tokens", "8"],
     lambda r: len(r["1x64"]["fsdp2_gather_off"]["peak_rss_gib_per_rank"]) == 2
     and r["1x64"]["fsdp2_over_fsdp2_gather_off_peak"]),
    (["packing", "--repeats", "1", "--steps", "2", "--block-size", "32", "--model", "gpt"],
     lambda r: r["packed"]["targets_per_step"] > r["padded"]["targets_per_step"] > 0),
    (["data", "--repeats", "1", "--prepare-tokens", "200000", "--small", "300000", "--large", "3000000",
      "--steps", "2", "--launch-rounds", "2", "--pairs", "2000",
      "--parts", "tokenizer,prepare,tiny,startup,wait,loaders,pairs"],
     lambda r: r["prepare, 2 worker(s)"]["tokens_per_s"] * r["data=shards, 3,000,000 tokens"]["first_step_s"]
     * r["loader, data=stream (one Parquet file, data.reshard=true), block 256, 2 workers"]["tokens_per_s"]
     * r["host time per step, data=shards, 5 x 12 x 1024, 2 workers"]["median_ms"]
     * r["host time per step, data=shards, 5 x 12 x 1024, data.read_ahead=true"]["median_ms"]
     * r["host work per step beside the reader"]["data.read_ahead=true"]["host_work_off_cpu_ms"]
     * r["prepare tiny Shakespeare, 2 worker(s)"]["tokens_per_s"] * r["tiny Shakespeare, data=shards"]["first_step_s"]
     * r["prepare 2,000 pairs, 2 worker(s)"]["pairs_per_s"]
     * r["2,000 pairs, data=shards: start to the first step"]["first_step_s"]),
    (["preference", "--repeats", "1", "--steps", "6", "--layers", "1", "--width", "64", "--log-every", "2"],
     lambda r: r["lora: ours over trl, step time"] * r["full: ours over trl, step time"]
     * r["ours lora"]["peak_rss_gib"] * r["trl full"]["peak_rss_gib"]),
    (["preference", "--packing", "--repeats", "1", "--steps", "6", "--layers", "1", "--width", "64",
      "--log-every", "2"],
     lambda r: r["packed over padded, step time"] * (r["ours lora, padded"]["model_tokens_per_step"]
                                                    > r["ours lora, packed"]["model_tokens_per_step"])),
    (["optimizers", "trainer.log_every=1", "--steps", "3", "--seeds", "1", "--variants", "optimizer=adamw",
      "optimizer=muon"],
     lambda r: r["optimizer=muon: mean"]["full_val_loss"] * r["optimizer=adamw: mean"]["ms_per_step"]),
    (["schedules", "trainer.log_every=1", "--lengths", "4", "6", "--seeds", "1"],
     lambda r: r["wsd: mean"]["full_val_loss"]["4"] * r["cosine: mean"]["full_val_loss"]["6"]
     * (r["wsd: mean"]["steps for every length"] < r["cosine: mean"]["steps for every length"])),
    (["distill", "trainer.log_every=1", "trainer.max_steps=3", "--seeds", "1", "--kd-ratios", "1.0"],
     lambda r: r["teacher"]["full_val_loss"] * r["mean"]["distill kd_ratio=1.0"]["full_val_loss"]
     * r["mean"]["data alone"]["ms_per_step"]),
    (["loss-memory", "--objective", "distill", "--vocab", "32000", "--tokens", "128", "--batch", "2", "--n-embd",
      "32", "--chunk-tokens", "64"],
     lambda r: r["chunk_tokens=null"]["step_peak_gib"] * (r["loss_difference"] < 1e-2)),
    (["teacher-memory", "--teachers", "2x64"],
     lambda r: len(r["teacher 2x64"]["export, read in slices: MiB per rank over a tiny teacher's run"]) == 2
     and r["teacher 2x64"]["teacher_mib"] and r["reward model 2x64"]["reward_model_mib"]
     and len(r["reward model 2x64"]["export, read in slices: MiB per rank over a tiny reward model's run"]) == 2),
    (["grpo", "--repeats", "1", "--steps", "6", "--layers", "1", "--width", "64", "--prompts", "2", "--generations",
      "2", "--completion", "8", "--log-every", "2"],
     lambda r: r["ours micro_batch over trl, step time"] * r["ours prompt over trl, step time"]
     * r["ours num_iterations=2 over trl num_iterations=2, step time"]),
], ids=["startup", "checkpoint", "stop-vote", "scale", "scale-grpo", "packing", "data", "preference",
        "preference-packing", "optimizers", "schedules", "distill", "loss-memory-distill", "teacher-memory", "grpo"])
def test_the_cpu_benchmarks_run_through_at_a_small_size(tmp_path, command, measured):
    """One quick run of each, each checked for the figure BENCHMARKS.md quotes from it."""
    args = [*command, "--dir", str(tmp_path)] if command[0] in ("checkpoint", "scale") else command
    assert measured(benchmark_report(args)) > 0


def test_the_development_page_describes_every_benchmark_and_benchmarks_md_links_only_inside_the_repository():
    import re

    from scripts.benchmark import BENCHMARKS

    page = (ROOT / "docs" / "development.md").read_text()
    names = [module.__name__.rsplit(".", 1)[1].replace("_", "-") for module in BENCHMARKS]
    assert [name for name in names if f"`{name}`" not in page] == []
    results = (ROOT / "scripts" / "BENCHMARKS.md").read_text()  # a clone has no ../shared of the team's
    assert re.findall(r"\.\./shared", results) == []

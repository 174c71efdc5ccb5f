"""scripts/benchmark.py stays runnable: its figures are measured rarely (the GPU ones only when a GPU is lent),
so a change that breaks it must show here first, not on the day of the measurement."""

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT, run


@pytest.mark.parametrize("overrides", [[], ["experiment=nanogpt_shakespeare_char"],
                                       ["experiment=owt_tokens", "data.path=train.bin", "data.vocab_size=50304"]])
def test_the_benchmarks_compose_the_configs_they_run(overrides):
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    cfg = benchmark.compose_config(overrides)
    assert cfg.model._target_ and cfg.trainer.max_steps > 0


@pytest.mark.slow
def test_the_parity_benchmarks_hand_written_loop_trains_the_templates_weights_bitwise():
    """Its step-time ratio means something only while the hand-written loop makes exactly train.py's arithmetic."""
    proc = run(["parity", "--repeats", "1", "--steps", "6", "--log-every", "2", "--processes", "1", "2"],
               command=[sys.executable, "scripts/benchmark.py"], timeout=600)
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict["1"]["weights_equal"] and verdict["2"]["weights_equal"], verdict

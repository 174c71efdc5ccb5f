"""trainer.mixed_precision=auto picks bf16 only where the device computes it natively; emulated bf16 is warned of."""

import logging

from omegaconf import OmegaConf

from src.launch.precision import cpu_bf16_flags, resolve_precision
from tests.conftest import QUIET, TINY_GPT, run

XEON = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse avx2 sha_ni\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_auto_is_bf16_on_cpus_with_bf16_instructions_and_fp32_on_the_others(caplog):
    assert resolve_precision("auto", "config", XEON) == ("bf16", "auto: a CPU with amx_bf16, avx512_bf16")
    assert resolve_precision("auto", "config", GRAVITON)[0] == "bf16"
    precision, source = resolve_precision("auto", "config", EPYC)
    assert precision == "no" and "without bf16 instructions" in source
    with caplog.at_level(logging.WARNING):
        assert resolve_precision("bf16", "config: trainer.mixed_precision", EPYC)[0] == "bf16"  # as asked, but:
    assert "bf16 is emulated there" in caplog.text and "trainer.mixed_precision=auto" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resolve_precision("bf16", "config", XEON)
    assert not caplog.text


def test_an_experiment_written_for_gpus_runs_at_the_precision_this_machine_has(tmp_path):
    proc = run(["experiment=shakespeare_char", *TINY_GPT, *QUIET, "data.batch_size=4",
                "trainer.max_steps=2", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / 'run'}"])
    expected = "bf16" if cpu_bf16_flags() else "no"  # the suite's processes see no GPU (tests/conftest.py)
    assert f"mixed precision             : {expected} (auto: " in proc.stdout
    assert "Removed shared tensor" not in proc.stdout  # the GPT's tied embedding, saved three times
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").trainer.mixed_precision == expected  # what was in effect

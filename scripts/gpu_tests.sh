#!/usr/bin/env bash
# The `gpu`-marked tests on a lent GPU machine whose image has torch but lacks our pinned Python packages.
# Beforehand, here (a machine with pip access), put the wheels in .whl/ (ignored by git):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1 transformers==5.23.0 peft==0.21.2
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # omegaconf's parser: an sdist only on PyPI
# Then run there, carrying .whl:  bash scripts/gpu_tests.sh [SECONDS] ["TEST IDS"]
# All 11 took 301 s on a cold H100 (2026-11-26), 398 s on another; the autotuned compile test alone 108 s.
# 2026-11-27: 13 without the autotuned one (--deselect it in the second argument) took 329 s on a cold H100.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, peft, accelerate, hydra, importlib.util as u; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'flash_attn', u.find_spec('flash_attn') is not None)"
timeout "${1:-470}" python3 -m pytest ${2:-tests/test_gpu.py tests/test_fsdp.py tests/test_packing.py tests/test_host_syncs.py tests/test_preference.py} \
    -m gpu -v -rA --durations=0 -p no:cacheprovider 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"

#!/bin/bash
# one-off GPU check (not committed): GPU tests, megatron tests, benchmarks
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/mc .wheels/*.whl > $OUT/setup.log 2>&1
bash .gpu/cublas-install.sh >> $OUT/setup.log 2>&1 && bash .gpu/te-setup.sh >> $OUT/setup.log 2>&1 || { echo SETUP FAILED; tail -30 $OUT/setup.log; exit 1; }
source .gpu/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
FDW_EXPECT_GROUPED=1 timeout 430 python3 -m pytest -m gpu tests -q -p no:cacheprovider > $OUT/gpu.log 2>&1; echo "gpu rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $OUT/gpu.log
grep -E "^(FAILED|ERROR)" $OUT/gpu.log | head -20
t0=$(date +%s)
PYTHONPATH=$PWD:/tmp/mc:$PYTHONPATH timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_megatron.py tests/test_megatron_gpu.py > $OUT/megatron.log 2>&1; echo "megatron rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $OUT/megatron.log
grep -E "^(FAILED|ERROR)" $OUT/megatron.log | head -10

#!/bin/bash
set -u
source .gpu/env.sh 2>/dev/null || { bash .gpu/te-setup.sh > /dev/null 2>&1; source .gpu/env.sh; }
export PYTHONPATH=$PWD:$PYTHONPATH
t0=$(date +%s)
timeout 200 python3 benchmarks/moe_layer.py --shapes quick --routing balanced --repeats 5 --budget 150 --only torch,fd,fd_1w,rowwise --out $OUT/moe_layer > $OUT/moe_layer.log 2>&1; echo "layer rc=$? $(( $(date +%s)-t0 ))s"
t0=$(date +%s)
timeout 200 python3 benchmarks/moe_mlp.py --shapes 0,3 --routing balanced --repeats 5 --budget 150 --only torch,fd,fd_list,fd_rowwise --out $OUT/moe_mlp > $OUT/moe_mlp.log 2>&1; echo "mlp rc=$? $(( $(date +%s)-t0 ))s"
grep -A12 "## balanced" $OUT/moe_layer/results.md | head -12
grep -A8 "## balanced" $OUT/moe_mlp/results.md | head -8

#!/usr/bin/env bash
# Restart-mode recovery with the model on an NVIDIA GPU: one rank, a snapshot in host memory every
# step and a universal checkpoint every 2 (the node's keeper writes it from the memory slot), killed
# at step 6 and hung at step 12, each relaunched from the newest snapshot. Each run's summary and the
# largest relative loss difference against a failure-free run go to $OUT/gpu-restart.json.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_restart.sh      (lightgbm and ortools from .whl/ when missing)
#   DEVICE=cpu MODEL="--layers 2 --hidden 64 --heads 4" STEPS=16 bash benchmarks/gpu_restart.sh   (the same on CPU)
set -u
OUT=${OUT:-/tmp/gpu-out}
R=$OUT/restart
mkdir -p "$R"
source benchmarks/gpu_env.sh
python3 -c "import resihp.cli, resihp.train.worker" || exit 1
MODEL=${MODEL:-"--layers 8 --hidden 1024 --heads 16 --lr 2e-4"}
for arm in ff stop hang; do
    case $arm in
        ff) inject="" ;;
        stop) inject="--inject stop:rank=0,step=6" ;;
        hang) inject="--inject hang:rank=0,step=12" ;;
    esac
    rm -rf "${R:?}/$arm"
    timeout 150 python3 -m resihp.cli run --device ${DEVICE:-cuda} --dp 1 --pp 1 --steps ${STEPS:-30} $MODEL \
        --snapshot-every 1 --ckpt-every 2 --recovery restart --hang-timeout 5 $inject --json \
        -o "$R/$arm" > "$R/$arm.json" 2> "$R/$arm.err"
    echo "$arm: rc $?"; tail -3 "$R/$arm.err"
done
python3 benchmarks/gpu_compare.py "$R" gpu-restart ff stop hang > "$OUT/gpu-restart.json"
cat "$OUT/gpu-restart.json"

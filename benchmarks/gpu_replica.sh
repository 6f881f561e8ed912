#!/usr/bin/env bash
# Issue 15's check on a machine with an NVIDIA GPU: replica-level fault tolerance with the model on
# the GPU (two replicas; on a one-GPU machine they share it, so the cross-replica sums and the
# catch-up stream go through gloo from host memory). A failure-free run, then one rank killed and
# one hung at step 10; each run's summary and the largest relative loss difference against the
# failure-free run (and over the steps before the fault: the GPU's run-to-run noise) go to
# $OUT/gpu-replica.json.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_replica.sh      (lightgbm from .whl/ when the machine lacks it)
#   OUT=/tmp/gpu ARMS="ff stop-2nodes" bash benchmarks/gpu_replica.sh   (results/gpu-replica-2nodes.json)
set -u
OUT=${OUT:-/tmp/gpu-out}
R=$OUT/replica
mkdir -p "$R"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/machine.txt" 2>&1
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" >> "$R/machine.txt" 2>&1
python3 -c "import resihp.cli, resihp.train.worker" || exit 1
cat "$R/machine.txt"
# a learning rate at which this model trains stably: at 1e-3 its loss climbs again after step 25, and
# any difference in reduction order grows from there
MODEL="--layers ${LAYERS:-8} --hidden ${HIDDEN:-1024} --heads 16 --lr ${LR:-2e-4}"
# ARMS: ff, stop, hang (one launcher), stop-2nodes (two launchers on this machine, one replica each:
# node 1's launcher relaunches its replica when node 0 evicts it)
for arm in ${ARMS:-ff stop hang}; do
    case $arm in
        ff) inject="" ;;
        stop|stop-2nodes) inject="--inject stop:rank=1,step=10" ;;
        hang) inject="--inject hang:rank=1,step=10" ;;
    esac
    run="python3 -m resihp.cli run --device cuda --dp 2 --pp 1 --steps ${STEPS:-120} --recovery replica $MODEL $inject --json"
    if [ "$arm" = stop-2nodes ]; then
        nodes="--nnodes 2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:29561"
        # every node of a job is launched with the same secret
        export RESIHP_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
        timeout 150 $run $nodes --node-rank 1 -o "$R/$arm-node1" > "$R/$arm-node1.json" 2> "$R/$arm-node1.err" &
        timeout 150 $run $nodes --node-rank 0 -o "$R/$arm" > "$R/$arm.json" 2> "$R/$arm.err"
        echo "$arm: rc $?"; wait; echo "$arm node 1: $(cat "$R/$arm-node1.json") $(tail -2 "$R/$arm-node1.err")"
    else
        timeout 150 $run -o "$R/$arm" > "$R/$arm.json" 2> "$R/$arm.err"
        echo "$arm: rc $?"
    fi
    tail -3 "$R/$arm.err"
    tar czf "$OUT/$arm-run.tgz" -C "$R/$arm" logs summary.json 2>/dev/null
done
# two ranks on one GPU without replicas: NCCL would refuse them; resihp says so before launching
python3 -m resihp.cli run --device cuda --dp 2 --steps 2 -o "$R/shared" > /dev/null 2> "$R/shared.err"
echo "shared GPU without replicas: rc $? $(cat "$R/shared.err")"
python3 benchmarks/gpu_compare.py "$R" gpu-replica ff stop hang stop-2nodes --before 10 > "$OUT/gpu-replica.json"
cat "$OUT/gpu-replica.json"

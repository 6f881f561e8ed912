#!/usr/bin/env bash
# Issue 18's checks on a machine with an NVIDIA GPU, in one call (each part with its own time limit,
# results packed into $OUT/gpu-results.tgz after every part, so a part cut short loses only itself):
#   1. `resihp profile --device cuda --dtype bfloat16` on three decoder shapes (hidden 2048-4096),
#      code/text/changelog lengths, 110 micro-batches per source (330 per shape), 3 repeats;
#   2. benchmarks/gpu.py snapshot: the memory tier's GPU snapshot against a synchronous dcp.save;
#   3. benchmarks/gpu.py attach: resihp.attach's overhead on a bf16 GPT training step;
#   4. the GPU cases of the snapshot and attach tests.
# The predictor is trained afterwards, on any machine, from the profiles (resihp predictor train).
#
#   OUT=/tmp/gpu bash benchmarks/gpu.sh      (lightgbm from .whl/ when the machine lacks it)
set -u
OUT=${OUT:-/tmp/gpu-out}
R=/tmp/gpu-results
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import lightgbm" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
pack() { tar czf "$OUT/gpu-results.tgz" -C "$R" . ; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    df -h /dev/shm /tmp; nproc; free -g
} > "$R/machine.txt" 2>&1
cat "$R/machine.txt"
# the memory tier lives in /dev/shm: make room for two slots of the snapshot benchmark's state
shm_gb=$(df --output=size -BG /dev/shm | tail -1 | tr -dc 0-9)
if [ "${shm_gb:-0}" -lt 16 ]; then mount -o remount,size=24G /dev/shm && df -h /dev/shm >> "$R/machine.txt"; fi
pack

for shape in "2048 16 8192 4" "3072 24 12288 4" "4096 32 16384 2"; do
    set -- $shape
    name="h$1-l$4"
    timeout 120 python3 -m resihp.cli profile --device cuda --dtype bfloat16 \
        --hidden "$1" --heads "$2" --ffn-hidden "$3" --layers "$4" --budget 4096 --max-len 4096 \
        --source code --source text --source changelog --microbatches 110 --repeats 3 \
        --model-name "gpt-$name" -o "$R/$name.parquet" --json > "$R/$name.summary.json" 2> "$R/$name.err"
    echo "profile $name: rc $? $(head -c 400 "$R/$name.summary.json")"
    tail -3 "$R/$name.err"
    pack
done

timeout 120 python3 benchmarks/gpu.py snapshot --layers 3 > "$R/gpu-snapshot.json" 2> "$R/gpu-snapshot.err"
echo "snapshot: rc $?"; tail -5 "$R/gpu-snapshot.err"
python3 -c "import json,sys; d=json.load(open('$R/gpu-snapshot.json')); print({k: v for k, v in d.items() if not isinstance(v, (dict, list))})" 2>&1 | tail -2
pack

timeout 80 python3 benchmarks/gpu.py attach > "$R/gpu-attach.json" 2> "$R/gpu-attach.err"
echo "attach: rc $?"; tail -5 "$R/gpu-attach.err"
python3 -c "import json,sys; d=json.load(open('$R/gpu-attach.json')); print({k: v for k, v in d.items() if not isinstance(v, (dict, list))})" 2>&1 | tail -2
pack

timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_ckpt_memory.py tests/test_runtime_attach.py -k cuda > "$R/tests-cuda.txt" 2>&1
echo "cuda tests: rc $?"; tail -4 "$R/tests-cuda.txt"
pack

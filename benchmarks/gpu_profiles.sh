#!/usr/bin/env bash
# Issue 18's profiles alone (part 1 of benchmarks/gpu.sh, with a tighter time limit per shape):
#   OUT=/tmp/gpu bash benchmarks/gpu_profiles.sh
set -u
OUT=${OUT:-/tmp/gpu-out}
R=/tmp/gpu-profiles
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import lightgbm" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
for shape in "2048 16 8192 4" "4096 32 16384 2" "3072 24 12288 4"; do
    set -- $shape
    name="h$1-l$4"
    timeout "${PROFILE_LIMIT_S:-60}" python3 -m resihp.cli profile --device cuda --dtype bfloat16 \
        --hidden "$1" --heads "$2" --ffn-hidden "$3" --layers "$4" --budget 4096 --max-len 4096 \
        --source code --source text --source changelog --microbatches 100 --repeats 3 \
        --model-name "gpt-$name" -o "$R/$name.parquet" --json > "$R/$name.summary.json" 2> "$R/$name.err"
    echo "profile $name: rc $? $(head -c 600 "$R/$name.summary.json")"
    tar czf "$OUT/gpu-profiles.tgz" -C "$R" .
done

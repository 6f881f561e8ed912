# Sourced by the GPU checks (gpu_restart.sh, gpu_replica.sh): unbuffered Python, this checkout on
# the path, one intra-op thread per rank, and lightgbm and ortools from .whl/ where the machine's
# image lacks them (README of the device tool: wheels travel with `carry`).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
if ! python3 -c "import lightgbm, ortools" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

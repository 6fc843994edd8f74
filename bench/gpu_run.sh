#!/bin/bash
# The GPU checks, as one command on a machine with a CUDA GPU and no registry (the `device`
# tool's: its python3 has jax with CUDA, orbax-checkpoint, tensorstore and torch; crc32c travels
# as a wheel in .whl/). Puts cairn on the path without installing it, runs the train-state
# tests with JAX's default device on the GPU, then bench/bench_gpu.py. Results go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/tree/cairn
ln -sfn "$PWD/manager" /tmp/tree/cairn/manager
ln -sfn "$PWD/handlers" /tmp/tree/cairn/handlers
export PYTHONPATH=/tmp/tree:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 - <<'PY'
import importlib.metadata as md, jax
print({d: md.version(d) for d in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")},
      jax.devices(), [m.kind for m in jax.devices()[0].addressable_memories()])
PY
df -h . /tmp | tail -2
JAX_PLATFORMS=cuda timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rf -p no:cacheprovider --timeout 40 \
    tests/handlers/test_train_state.py tests/handlers/test_staging.py tests/handlers/test_packed.py \
    tests/manager/test_incremental.py -k "not s3 and not sharded_arrays_save_per_shard" 2>&1 | tee "$OUT/pytest.log" | tail -40
(cd bench && JAX_PLATFORMS=cuda timeout "${BENCH_TIMEOUT:-300}" python3 bench_gpu.py --out "$OUT/gpu.json" ${BENCH_ARGS:-}) 2>&1 | tee "$OUT/bench.log" | grep -v '^|'
echo "=== bench tables ==="
grep '^|\|^\*\*' "$OUT/bench.log"

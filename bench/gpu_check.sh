#!/usr/bin/env bash
# Where a CUDA device is lent: the quantized Linears' CUDA tests (gptqmodel's kernels when
# installed), then a batch-1 GEMV timing of the int4 (torch tinygemm) and int8 paths against
# bf16 on a 4096 x 4096 and a 14336 x 4096 weight, then the native engine against
# transformers on the GPU (bench/gpu_engine_check.py) when its models are in .gpu/ (write them
# here with `.venv/bin/python -m bench.gpu_engine_check --prepare .gpu`, exclude .gpu/ from git,
# and carry it). Needs torch with CUDA; bitsandbytes and gptqmodel optional. Prints everything;
# exits non-zero on a test failure.
# Usage: bash bench/gpu_check.sh [python]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${1:-python3}"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""); sys.exit(0)'
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/quantized/test_cuda.py -k "not gptqmodel"
rc=$?
# gptqmodel's CUDA kernels (optional extra; skipped when not installed) under --quantized-kernels
# auto: prints the kernel each fixture gets. Its Marlin / ExLlamaV2 kernels JIT-compile on first
# use, which can take minutes.
"$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/quantized/test_cuda.py -k gptqmodel || rc=1
"$PY" - <<'PYEOF'
import time
import torch
from backends.quantized.affine import AffineInt4
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.int8_linear import Int8Linear, quantize_per_channel

dev = torch.device("cuda")


def timed(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


for n, k in [(4096, 4096), (14336, 4096)]:
    w = torch.randn(n, k) * 0.02
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    int4 = Int4Linear(AffineInt4.from_int_zeros(q, torch.rand(n, k // 128) * 1e-3,
                                                torch.full((n, k // 128), 8.0), 128),
                      None, dev, torch.bfloat16)
    qi, s = quantize_per_channel(w)
    int8 = Int8Linear(qi, s, None, dev, torch.bfloat16)
    dense = w.to(dev, torch.bfloat16)
    for rows in (1, 16):
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        print(f"[{n}x{k}] rows={rows}: bf16 {timed(lambda: x @ dense.t()):.1f} us, "
              f"int4 {int4.kernel} {timed(lambda: int4(x)):.1f} us, "
              f"int8 {int8.kernel} {timed(lambda: int8(x)):.1f} us")
PYEOF
if [ -d .gpu ]; then
    "$PY" -m bench.gpu_engine_check --models .gpu || rc=1
fi
exit $rc

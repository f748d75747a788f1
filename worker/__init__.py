"""eaglegate's engine core: model, tensor-parallel layers, KV cache, scheduler and the plain step of each rank."""

import os

# MKL's batched matmuls (row-wise attention) otherwise pick code paths by memory alignment, so the same row could
# round differently from one step to the next; strict mode makes every call reproducible, which keeps speculative
# output identical to plain output in bfloat16. Read at MKL's first call, so setting it at import suffices.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# a CPU class to pass for (`EAGLEGATE_CPU_CLASS`, `make test-cpu CLASS=avx2`): torch and oneDNN read their limits from
# the environment at first use, after this package's import
from worker.kernels.cpu_class import apply_env  # noqa: E402

apply_env()

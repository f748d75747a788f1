"""Fast paths under the model: quantized weight formats and the fused C++ CPU kernels (`csrc/`), Triton attention for
GPUs, and CUDA graph capture of decode steps."""

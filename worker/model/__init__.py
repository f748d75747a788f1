"""The target model on one rank: architecture configs, layers (dense, tensor-parallel, MoE), attention over the paged
KV cache, and loading weights and tokenizer from GGUF or safetensors."""

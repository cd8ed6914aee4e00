"""A servable model: built on `meta` from the archive's config, weights assigned where they were
decoded, gpt-fast style.

    build.py      ServedModel; prepare (config, tokenizer, skeleton) beside the decode, finish
                  (assign the weights), the start-up warm-up
    llama.py      Llama-family models (llama, mistral, qwen2, qwen3) in plain PyTorch; others use
                  transformers' Auto classes
    kvcache.py    the KV caches llama.py's models write into
    tokenizer.py  fast tokenizers without transformers, chat templates (jinja2)
    compressed.py weights="compressed", the indexed form: decoder layers kept as streams on the
                  device, each module decoded into scratch buffers just before it runs
    fixed.py      weights="compressed" on CUDA, the fixed-rate form: matrices multiplied by the
                  fused decode-matmul
    quantized.py  weights="compressed", GGUF archives: matrices kept as their blocks, dequantized
                  before each matmul; the embedding dequantizes the rows it gathers
    cpu_dtype.py  how a model computes on the CPU (WCODEC_CPU_DTYPE)
"""

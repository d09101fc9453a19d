"""The models: where a folder comes from (built-in names, GGUF files, the cache) and how the
policy, the reference and the tokenizer are loaded (dtype, device, LoRA, quantization)."""

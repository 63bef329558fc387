"""The data behind the estimator of pagedopt.memory: dtype sizes, GPU capacities, the optimizers it
estimates (and the other names they go by) and Llama-like model presets. Data only: no imports."""

GIB = 1 << 30

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# GPU capacities in GiB, nominal (as marketed: 24 GB cards hold 24 GiB); the usable amount is a
# little smaller (the driver keeps some, ECC on some cards).
GPUS = {
    "T4": 16, "V100-16": 16, "V100-32": 32, "V100": 32, "A10": 24, "A10G": 24, "L4": 24, "L40S": 48,
    "RTX3090": 24, "RTX4090": 24, "RTX5090": 32, "RTXA6000": 48, "A6000": 48,
    "A100-40": 40, "A100-80": 80, "A100": 80, "H100-80": 80, "H100": 80, "H100-94": 94, "H200": 141,
    "B200": 180, "MI300X": 192,
}

# Optimizer kinds: (label, state width or None for torch, paged).
# name -> (class, state bits (None: torch's AdamW, states in the parameter's dtype), paged, moments
# per parameter: Lion, SGD with momentum, RMSprop and Adagrad keep 1, Adam 2, AdEMAMix 3).
OPTIMIZERS = {
    "adamw_torch": ("torch.optim.AdamW", None, False, 2),
    "adamw_torch_fused": ("torch.optim.AdamW(fused=True)", None, False, 2),
    "adamw_8bit": ("pagedopt.AdamW8bit", 8, False, 2),
    "paged_adamw_8bit": ("pagedopt.PagedAdamW8bit", 8, True, 2),
    "adamw_32bit": ("pagedopt.AdamW32bit", 32, False, 2),
    "paged_adamw_32bit": ("pagedopt.PagedAdamW32bit", 32, True, 2),
    "adamw_4bit": ("pagedopt.AdamW4bit", 4, False, 2),
    "paged_adamw_4bit": ("pagedopt.PagedAdamW4bit", 4, True, 2),
    "lion_4bit": ("pagedopt.Lion4bit", 4, False, 1),
    "paged_lion_4bit": ("pagedopt.PagedLion4bit", 4, True, 1),
    "lion_8bit": ("pagedopt.Lion8bit", 8, False, 1),
    "paged_lion_8bit": ("pagedopt.PagedLion8bit", 8, True, 1),
    "lion_32bit": ("pagedopt.Lion32bit", 32, False, 1),
    "ademamix_8bit": ("pagedopt.AdEMAMix8bit", 8, False, 3),
    "paged_ademamix_8bit": ("pagedopt.PagedAdEMAMix8bit", 8, True, 3),
    "ademamix_32bit": ("pagedopt.AdEMAMix32bit", 32, False, 3),
    "sgd_8bit": ("pagedopt.SGD8bit (momentum > 0)", 8, False, 1),
    "rmsprop_8bit": ("pagedopt.RMSprop8bit", 8, False, 1),
    "adagrad_8bit": ("pagedopt.Adagrad8bit", 8, False, 1),
    "lars_8bit": ("pagedopt.LARS8bit", 8, False, 1),
    "lamb_8bit": ("pagedopt.LAMB8bit", 8, False, 2),
}
# bytes per parameter tensor beyond its moments and step: LARS and LAMB keep unorm_vec (one fp32)
EXTRA_STATE_BYTES = {"lars_8bit": 4, "lamb_8bit": 4}
# other names of the optimizers above (normalize_optimizer)
ALIASES = {"adamw": "adamw_torch", "torch": "adamw_torch", "adam_torch": "adamw_torch", "torch_fused": "adamw_torch_fused",
           "adam_8bit": "adamw_8bit", "paged_adam_8bit": "paged_adamw_8bit", "adam_32bit": "adamw_32bit",
           "paged_adam_32bit": "paged_adamw_32bit", "adam_4bit": "adamw_4bit", "paged_adam_4bit": "paged_adamw_4bit"}

# Llama-like presets for --config NAME (published config.json values).
PRESETS = {
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
    "llama2-13b": dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, vocab_size=32000, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}

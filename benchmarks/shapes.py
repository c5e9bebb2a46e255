"""The Qwen2-0.5B shape the GPU benchmarks build with random weights (nothing downloaded)."""

QWEN2_05B: dict[str, object] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}

"""GPT-3-style decoder family: learned positions, LayerNorm, fused QKV, GELU, tied logits."""

"""Llama-style decoder family: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head."""

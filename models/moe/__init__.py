"""Mixture-of-experts decoder family: Llama's attention, a routed mixture of SwiGLU experts."""

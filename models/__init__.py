"""Reference model families, each written twice: once with Flax Linen, once with Flax NNX."""

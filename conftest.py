"""Give jax 8 host devices before any backend starts, unless the user chose otherwise."""

from conformance.core.environment import configure_host_platform

configure_host_platform()

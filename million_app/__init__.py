"""The application layer: the ``million-jax`` command line and what it drives.

Top of the one-way dependency chain ``million_app -> models -> million_jax -> pallas_kernels``;
nothing below imports this package.
"""

"""``python -m million_jax ...`` runs the ``million-jax`` command line."""
from million_jax.cli import entry

entry()

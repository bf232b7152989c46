"""``python -m million_app ...`` runs the ``million-jax`` command line."""
from million_app.cli import entry

entry()

"""The ``million-jax`` subcommands: one module each, in :data:`REGISTRY` (name -> module).

Every module has ``HELP`` (its line in ``million-jax --help``), ``add_parser(subparsers)``
(its own flags; shared groups in :mod:`million_app.commands.flag_groups`) and
``run(args) -> exit status``. :mod:`million_app.cli` walks the registry to build the parser
and runs ``REGISTRY[args.command].run`` (looked up at run time).
"""
from __future__ import annotations

from types import ModuleType

from million_app.commands import calibrate, demo, eval, generate, niah, passkey, sweep

REGISTRY: dict[str, ModuleType] = {
    "calibrate": calibrate,
    "eval": eval,
    "sweep": sweep,
    "generate": generate,
    "passkey": passkey,
    "niah": niah,
    "demo": demo,
}

__all__ = ["REGISTRY"]

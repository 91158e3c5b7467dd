"""The `quantkit` command: a typer app whose commands live one per file in quantkit/commands/.

Errors of type QuantkitError print one line (no traceback unless QUANTKIT_DEBUG=1) and exit 2.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from quantkit.errors import QuantkitError

COMMAND_MODULES = ["calibrate", "info", "eval", "export", "push", "serve", "bench", "plan"]

_typer_app = typer.Typer(
    name="quantkit",
    help="FP16 -> calibrated INT4/INT8 -> served, with the accuracy delta measured on your data.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

for _name in COMMAND_MODULES:
    importlib.import_module(f"quantkit.commands.{_name}").register(_typer_app)


def app() -> None:
    """Console-script entry point."""
    try:
        _typer_app()
    except QuantkitError as e:
        if os.environ.get("QUANTKIT_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app()

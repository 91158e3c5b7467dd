"""The one error type: its message is a single actionable line the CLI prints without a traceback."""


class QuantkitError(Exception):
    """A user-facing error. `str(err)` must say what is wrong and what to do about it.

    Name the file, line and field where there is one: `data.jsonl:12: field "messages": expected a list`.
    """

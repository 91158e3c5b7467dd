"""`quantkit export DIR --format gptq|gptq_v2|awq|compressed-tensors --out DIR2`: same codes, another layout."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def export(
        folder: Path = typer.Argument(..., help="quantized checkpoint folder (quantkit's, GPTQModel's, AutoAWQ's, llm-compressor's)"),
        format: str = typer.Option(..., "--format", help="gptq | gptq_v2 | awq | compressed-tensors"),
        out: Path = typer.Option(..., "--out", help="folder to write (replaced if it is a checkpoint)"),
    ) -> None:
        """Rewrite a checkpoint in another layout from the same integer codes, without recalibrating."""
        from quantkit.export import export as export_folder
        from quantkit.formats.compatibility import written_note

        written = export_folder(folder, format, out)
        typer.echo(f"wrote {written} ({format})")
        typer.echo(written_note(written))

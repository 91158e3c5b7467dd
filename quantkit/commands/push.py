"""`quantkit push DIR --repo OWNER/NAME` and `quantkit card DIR` (the model card alone, nothing uploaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def push(
        folder: Path = typer.Argument(..., help="checkpoint folder (from `quantkit calibrate` or `quantkit export`)"),
        repo: str = typer.Option(..., "--repo", help="OWNER/NAME on the Hub; created if missing"),
        private: bool = typer.Option(False, "--private", help="create the repo private (ignored if it exists)"),
        revision: Optional[str] = typer.Option(None, "--revision", help="branch to commit to (created from main)"),
        commit_message: Optional[str] = typer.Option(None, "--commit-message", help="default: 'Upload METHOD SCHEME (LAYOUT) checkpoint with quantkit'"),
    ) -> None:
        """Upload the folder in one commit, model card included (regenerated unless hand-written). Token: HF_TOKEN or `hf auth login`; endpoint: HF_ENDPOINT."""
        from quantkit.hub import push as push_folder

        url = push_folder(folder, repo, private=private, revision=revision, commit_message=commit_message)
        typer.echo(f"pushed {folder} to {repo}: {url}")

    @app.command()
    def card(
        folder: Path = typer.Argument(..., help="checkpoint folder"),
        repo: Optional[str] = typer.Option(None, "--repo", help="OWNER/NAME the usage snippets name (default: the folder)"),
    ) -> None:
        """Write FOLDER/README.md: metadata, eval table, recipe, calibration data, loading and usage."""
        from quantkit.card import write_card

        typer.echo(f"wrote {write_card(folder, repo)}")

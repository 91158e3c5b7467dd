"""Push a checkpoint folder to the Hugging Face Hub in ONE commit, with a generated model card.

Order of calls: create_repo(exist_ok) -> create_branch(revision, exist_ok) -> create_commit(all files). LFS objects
are uploaded before the commit; the branch only changes when the commit lands, so a failure anywhere leaves the
repo as it was. The endpoint is HF_ENDPOINT (read at call time), the token HF_TOKEN or the `hf auth login` one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from quantkit.errors import QuantkitError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
DEFAULT_ENDPOINT = "https://huggingface.co"


def push(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Upload every file of `folder` to `repo_id` in one commit; returns the commit URL.

    README.md is (re)generated with `repo_id` in its snippets unless the folder holds a hand-written one.
    """
    import httpx2
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    from quantkit.card import is_generated, read_meta, render_card, write_card

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise QuantkitError(f"{folder}: no config.json here: pass the folder `quantkit calibrate --out` wrote")
    if not REPO_ID.match(repo_id):
        raise QuantkitError(f'--repo "{repo_id}": expected OWNER/NAME, e.g. alice/SmolLM2-135M-Instruct-gptq-w4g128')
    token = token or get_token()
    if not token:
        raise QuantkitError(
            "no Hugging Face token: set HF_TOKEN to a write token (https://huggingface.co/settings/tokens) "
            "or run `hf auth login`"
        )
    readme = folder / "README.md"
    # a card someone wrote by hand is uploaded as it is; a generated one is rendered for this repo and written into
    # the folder only once the commit landed, so a failed push leaves the folder as it was
    card = render_card(folder, repo_id) if not readme.is_file() or is_generated(readme) else None
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not _hidden(p.relative_to(folder))
                   and not (card is not None and p == readme))
    operations = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=p) for p in files]
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or _default_message(read_meta(folder)),
            revision=revision,
        )
    except HfHubHTTPError as e:
        raise QuantkitError(_explain(e.response.status_code, repo_id, revision, str(e.response.url), e)) from e
    except httpx2.TransportError as e:
        raise QuantkitError(
            f"cannot reach the Hub at {endpoint} ({type(e).__name__}: {e}): check the network connection "
            "and HF_ENDPOINT; nothing was uploaded"
        ) from e
    if card is not None:
        write_card(folder, text=card)
    return info.commit_url


def _hidden(rel: Path) -> bool:
    """Dotfiles, dot-folders (.cache, .git) and temp files never leave the machine."""
    return any(part.startswith(".") or part.endswith(".tmp") for part in rel.parts)


def _default_message(meta: dict | None) -> str:
    """'Upload GPTQ w4g128 (gptq) checkpoint with quantkit' from quantkit.json."""
    if not meta:
        return "Upload model with quantkit"
    words = [meta.get("method", "quantized").upper(), meta.get("scheme_name"), f"({meta['layout']})" if meta.get("layout") else None]
    return f"Upload {' '.join(w for w in words if w)} checkpoint with quantkit"


def _explain(status: int, repo_id: str, revision: str | None, url: str, err: Exception) -> str:
    """One actionable line per HTTP status the Hub answers a push with."""
    owner = repo_id.split("/")[0]
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if status == 401:
        return (
            f"the Hub rejected the token (401 at {url}): set HF_TOKEN to a valid token with write access "
            "(https://huggingface.co/settings/tokens) or run `hf auth login`"
        )
    if status == 403:
        return (
            f"no write access to {repo_id} (403 at {url}): use a token with write permission on the '{owner}' "
            "namespace (a fine-grained token needs 'write' on that repo or org), or push to a repo you own"
        )
    if status == 404:
        what = f"branch '{revision}' of {repo_id}" if revision else repo_id
        return (
            f"{what} was not found (404 at {url}): check the repo id and that your token can see it "
            "(a private repo of another account reads as missing)"
        )
    return f"the Hub answered {status} at {url}: {first}; nothing was committed, retry later"

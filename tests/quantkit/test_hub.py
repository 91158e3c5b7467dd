"""`quantkit push` against a real HTTP Hub stand-in on 127.0.0.1 (tests/quantkit/hub_standin.py), through huggingface_hub."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from quantkit.card import MARKER
from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import quantization_config
from quantkit.hub import push
from tests.quantkit.hub_standin import HubStandin

CARD = "---\nlicense: apache-2.0\ntags:\n- quantized\n---\n# tiny\n"


@pytest.fixture
def checkpoint(tmp_path):
    """A small checkpoint folder: one binary (LFS) file, text (regular) files, a sub-folder and a dotfile."""
    d = tmp_path / "ckpt"
    (d / "eval").mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({"model.layers.0.mlp.down_proj.qweight": rng.integers(-(2**31), 2**31 - 1, (16, 64), dtype=np.int32)}, d / "model.safetensors")
    qcfg = quantization_config(QuantScheme(4, 128), "gptq", "llama", [])
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qcfg}))
    (d / "quantkit.json").write_text(json.dumps({"method": "gptq", "scheme_name": "w4g128", "layout": "gptq"}))
    (d / "README.md").write_text(CARD)
    (d / "eval" / "report.json").write_text("{}")
    (d / ".cache").mkdir()
    (d / ".cache" / "scratch").write_text("local only")
    return d


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    with HubStandin(tokens={"hf_alice": "alice"}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        monkeypatch.setattr(constants, "ENDPOINT", h.endpoint)  # what HF_ENDPOINT sets when huggingface_hub is imported
        monkeypatch.setenv("HF_TOKEN", "hf_alice")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the stand-in speaks git-LFS, not Xet
        yield h


def expected_files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts}


def test_push_uploads_every_file_in_one_commit(hub, checkpoint):
    url = push(checkpoint, "alice/tiny-gptq", commit_message="first upload")

    repo = hub.repos["alice/tiny-gptq"]
    assert repo.private is False
    initial, ours = repo.branches["main"]  # the repo's initial commit, then exactly one commit from the push
    assert url == f"{hub.endpoint}/alice/tiny-gptq/commit/{ours.oid}"
    assert ours.summary == "first upload"
    assert ours.added == expected_files(checkpoint)
    assert sorted(ours.added) == ["README.md", "config.json", "eval/report.json", "model.safetensors", "quantkit.json"]
    # the binary went through the LFS batch API + PUT + verify; the text files inline in the NDJSON commit
    names = [name for name, _ in hub.calls]
    assert names == ["create", "validate-yaml", "preupload", "lfs-batch", "lfs-put", "lfs-verify", "commit"]
    assert list(hub.lfs.values()) == [(checkpoint / "model.safetensors").read_bytes()]


def test_push_private_to_a_branch_then_again(hub, checkpoint):
    push(checkpoint, "alice/tiny", private=True, revision="w4g128")
    repo = hub.repos["alice/tiny"]
    assert repo.private is True
    assert [c.summary for c in repo.branches["main"]] == ["initial commit"]
    assert repo.tree("w4g128") == {**expected_files(checkpoint), ".gitattributes": repo.tree("main")[".gitattributes"]}

    (checkpoint / "config.json").write_text('{"model_type": "llama"}')
    push(checkpoint, "alice/tiny", revision="w4g128")  # repo and branch exist now: both answer 409, the push goes on
    assert [name for name, _ in hub.calls].count("create") == 2
    # unchanged files are left out of the second commit; the LFS object is not uploaded again
    assert sorted(repo.branches["w4g128"][-1].added) == ["config.json"]
    assert [name for name, _ in hub.calls].count("lfs-put") == 1
    assert repo.branches["w4g128"][-1].summary == "Upload GPTQ w4g128 (gptq) checkpoint with quantkit"
    assert [c.summary for c in repo.branches["main"]] == ["initial commit"]


def test_push_writes_the_model_card_with_the_repo_id(hub, checkpoint):
    (checkpoint / "README.md").unlink()
    push(checkpoint, "alice/tiny-gptq")
    card = hub.repos["alice/tiny-gptq"].branches["main"][-1].added["README.md"].decode()
    assert card == (checkpoint / "README.md").read_text()  # the card pushed is the one left in the folder
    assert MARKER in card and "vllm serve alice/tiny-gptq" in card
    assert [name for name, _ in hub.calls].count("validate-yaml") == 1  # the Hub checked its metadata block

    (checkpoint / "README.md").write_text(card.replace(MARKER + "\n", "") + "My own notes.\n")
    push(checkpoint, "alice/other")  # without the marker the card is the user's: uploaded as it is
    assert hub.repos["alice/other"].branches["main"][-1].added["README.md"].decode().endswith("My own notes.\n")


def test_bad_token_is_one_clear_line(hub, checkpoint, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    with pytest.raises(QuantkitError) as e:
        push(checkpoint, "alice/tiny")
    assert str(e.value) == (
        f"the Hub rejected the token (401 at {hub.endpoint}/api/repos/create): set HF_TOKEN to a valid token with "
        "write access (https://huggingface.co/settings/tokens) or run `hf auth login`"
    )
    assert hub.repos == {}


def test_a_failed_push_leaves_the_folder_as_it_was(hub, checkpoint, monkeypatch):
    (checkpoint / "README.md").unlink()
    before = {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    with pytest.raises(QuantkitError, match="the Hub rejected the token"):
        push(checkpoint, "alice/tiny")
    assert {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()} == before  # no README.md left behind


def test_no_write_access_is_one_clear_line(hub, checkpoint):
    bob = hub.add_repo("bob/model", files={"README.md": b"bob's"})
    with pytest.raises(QuantkitError) as e:
        push(checkpoint, "bob/model")
    assert str(e.value) == (
        f"no write access to bob/model (403 at {hub.endpoint}/api/models/bob/model/preupload/main): use a token with "
        "write permission on the 'bob' namespace (a fine-grained token needs 'write' on that repo or org), "
        "or push to a repo you own"
    )
    assert bob.tree() == {".gitattributes": bob.tree()[".gitattributes"], "README.md": b"bob's"}


def test_private_repo_of_someone_else_reads_as_forbidden_and_a_vanished_repo_as_404(hub, checkpoint):
    hub.add_repo("bob/secret", private=True)
    with pytest.raises(QuantkitError, match=r"^no write access to bob/secret \(403 at .*/api/repos/create\)"):
        push(checkpoint, "bob/secret")

    hub.fail_next("preupload", 404)  # e.g. the repo was deleted between create_repo and the upload
    with pytest.raises(QuantkitError) as e:
        push(checkpoint, "alice/tiny")
    assert str(e.value) == (
        f"alice/tiny was not found (404 at {hub.endpoint}/api/models/alice/tiny/preupload/main): check the repo id "
        "and that your token can see it (a private repo of another account reads as missing)"
    )


def test_failed_commit_leaves_nothing_half_uploaded(hub, checkpoint):
    hub.fail_next("commit", 500)
    with pytest.raises(QuantkitError, match=r"^the Hub answered 500 at .*/commit/main: .*nothing was committed"):
        push(checkpoint, "alice/tiny")
    repo = hub.repos["alice/tiny"]
    assert [c.summary for c in repo.branches["main"]] == ["initial commit"]
    assert list(repo.tree()) == [".gitattributes"]


def test_unreachable_hub_and_missing_token(checkpoint, monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    with pytest.raises(QuantkitError, match=rf"^cannot reach the Hub at http://127.0.0.1:{port} \(ConnectError: .*\): check the network connection and HF_ENDPOINT; nothing was uploaded$"):
        push(checkpoint, "alice/tiny")

    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(QuantkitError, match=r"^no Hugging Face token: set HF_TOKEN"):
        push(checkpoint, "alice/tiny")
    with pytest.raises(QuantkitError, match=r'^--repo "tiny": expected OWNER/NAME'):
        push(checkpoint, "tiny", token="hf_alice")


def test_cli_push_and_its_error_line(checkpoint):
    with HubStandin(tokens={"hf_alice": "alice"}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_alice", "HF_HUB_DISABLE_XET": "1"}
        cmd = [sys.executable, "-m", "quantkit.cli", "push", str(checkpoint), "--repo", "alice/cli", "--revision", "v1", "--commit-message", "from the CLI"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        commit = hub.repos["alice/cli"].branches["v1"][-1]
        assert commit.summary == "from the CLI"
        assert out.stdout.strip().endswith(f"{hub.endpoint}/alice/cli/commit/{commit.oid}")

        out = subprocess.run(cmd, env={**env, "HF_TOKEN": "hf_bad"}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"error: the Hub rejected the token (401 at {hub.endpoint}/api/repos/create): set HF_TOKEN to a valid "
            "token with write access (https://huggingface.co/settings/tokens) or run `hf auth login`"
        ]

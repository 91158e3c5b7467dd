"""`quantkit calibrate` with an output or data it cannot use: exit 2, one line naming the path (and line), nothing
half-written. Real file systems: a tmpfs mounted read-only and one too small for the checkpoint (these two need
root, as CI runs; elsewhere they skip)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.evals.evals_tiny import save_tiny, tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny") / "model")


def calibrate(folder: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", str(folder), "--method", "rtn",
                           "--group-size", "32", *flags], capture_output=True, text=True, timeout=300, cwd=REPO)


def mounted_tmpfs(point: Path, options: str):
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    return point


@pytest.fixture
def mounts():
    points = []
    yield lambda point, options: points.append(mounted_tmpfs(point, options)) or point
    for point in points:
        subprocess.run(["umount", str(point)], check=True)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def test_an_out_whose_parent_is_a_file(tmp_path, tiny_folder):
    (tmp_path / "plain").write_text("a file")
    out = tmp_path / "plain" / "ck"
    line = one_error_line(calibrate(tiny_folder, "--out", str(out)))
    assert line == f"error: {out}: --out cannot be created: {tmp_path / 'plain'} is a file, not a folder"


def test_an_out_that_is_a_file(tmp_path, tiny_folder):
    out = tmp_path / "ck"
    out.write_text("keep me")
    assert one_error_line(calibrate(tiny_folder, "--out", str(out))) == f"error: {out}: --out is a file, not a folder"
    assert out.read_text() == "keep me"


def test_an_out_on_a_read_only_file_system(tmp_path, tiny_folder, mounts):
    readonly = mounts(tmp_path / "ro", "ro,size=1m")
    line = one_error_line(calibrate(tiny_folder, "--out", str(readonly / "ck")))
    assert line == f"error: {readonly / 'ck'}: --out cannot be written: {readonly} is not writable"


def test_a_full_disk_leaves_nothing_half_written(tmp_path, tiny_folder, mounts):
    small = mounts(tmp_path / "small", "size=256k")
    out = small / "ck"
    line = one_error_line(calibrate(tiny_folder, "--out", str(out), "--work-dir", str(tmp_path / "work")))
    assert line == f"error: {out}: cannot write the checkpoint (No space left on device); nothing was written"
    assert list(small.iterdir()) == []  # neither the checkpoint nor its temp folder


def test_data_that_is_not_utf8_names_the_file_and_line(tmp_path, tiny_folder):
    data = tmp_path / "latin1.txt"
    data.write_bytes(b"a fine first line\nun caf\xe9\n")
    done = calibrate(tiny_folder, "--method", "gptq", "--data", str(data), "--out", str(tmp_path / "ck"))
    assert one_error_line(done) == (f"error: {data}:2: not UTF-8 text (byte 0xe9 at column 7): save the file as "
                                    "UTF-8")
    assert not (tmp_path / "ck").exists()

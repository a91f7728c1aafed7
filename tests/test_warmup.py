"""A build lock left by an interrupted DeepSpeed op build is removed; a live build's lock is not."""

import os
import subprocess
import time

import pytest

from helpers.job.ops import AIO_OP, clear_stale_locks


def _lock(root, name, age_s):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return d, lock


def test_stale_lock_is_removed_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _, lock = _lock(tmp_path, AIO_OP, age_s=3600)
    notes = clear_stale_locks()
    assert not lock.exists()
    assert len(notes) == 1 and f"interrupted build of DeepSpeed's {AIO_OP} op" in notes[0] and "60 min" in notes[0]
    assert clear_stale_locks() == []  # nothing left to say


def test_fresh_or_busy_lock_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _, fresh = _lock(tmp_path, "deepspeed_shm_comm", age_s=5)  # a build that has just taken the lock
    busy_dir, busy = _lock(tmp_path, AIO_OP, age_s=3600)
    worker = subprocess.Popen(["sleep", "60"], cwd=busy_dir)  # stands for ninja, which runs in the build dir
    try:
        time.sleep(0.2)
        assert clear_stale_locks() == []
        assert fresh.exists() and busy.exists()
    finally:
        worker.kill()
        worker.wait()
    assert len(clear_stale_locks()) == 1 and not busy.exists() and fresh.exists()


def test_ops_build_into_the_checkout_unless_told_otherwise(tmp_path):
    """Two checkouts sharing ~/.cache/torch_extensions rebuild each other's ops; each gets its own by default."""
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    code = "import os, helpers; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    unset = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, check=True)
    assert unset.stdout.strip() == str(repo / "build" / "torch_extensions")
    given = subprocess.run([sys.executable, "-c", code], cwd=repo, env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
                           capture_output=True, text=True, check=True)
    assert given.stdout.strip() == str(tmp_path)


def test_ops_build_with_the_venvs_ninja_when_the_venv_is_not_activated(tmp_path):
    """A second ninja on PATH (/usr/bin's, another version) cannot read the venv ninja's build log and rebuilds
    every op from scratch; ``import helpers`` puts the venv's bin first, so both builds use the same one."""
    import shutil
    import sys

    venv_bin = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(venv_bin, "ninja")):
        pytest.skip(f"no ninja next to {sys.executable}")
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 0.0-other\n")
    other.chmod(0o755)
    code = "import helpers, shutil, subprocess; print(subprocess.check_output(['ninja', '--version'], text=True))"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    want = subprocess.check_output([os.path.join(venv_bin, "ninja"), "--version"], text=True)
    assert out.stdout.strip() == want.strip() != "0.0-other"
    assert shutil.which("ninja", path=env["PATH"]) == str(other)  # without helpers, the other one would run

"""Small things a learner meets first, each answered with one clear line: a true/false key's typo, a Python
outside the venv, the lab's URL on a remote machine, a busy --out, more ranks than cores, the warmup's words,
and where pip finds torch."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import FSDP, REPO, job_env

import helpers
from helpers.core.config_keys import _DS_KEYS, _FSDP_KEYS

# ---- 1. a true/false key's typo says true or false -----------------------------------------------------------

FSDP_V2 = "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
DS_INLINE = "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n"
BOOL_KEYS = ([("fsdp_config", k) for k, rule in _FSDP_KEYS.items() if rule is bool or k == "fsdp_reshard_after_forward"]
             + [("deepspeed_config", k) for k, rule in _DS_KEYS.items() if rule is bool])


def check_config(tmp_path, text: str, files: dict | None = None) -> tuple[int, list[str]]:
    """``python -m helpers.config bad.yaml --world-size 2`` (``files``: name -> text beside it): (exit code,
    stderr lines)."""
    (tmp_path / "bad.yaml").write_text(text)
    for name, content in (files or {}).items():
        (tmp_path / name).write_text(content)
    proc = subprocess.run([sys.executable, "-m", "helpers.config", str(tmp_path / "bad.yaml"), "--world-size", "2"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize("section,key", BOOL_KEYS, ids=[k for _, k in BOOL_KEYS])
def test_true_false_key_typo_says_true_or_false(tmp_path, section, key):
    base = FSDP_V2 if section == "fsdp_config" else DS_INLINE
    code, lines = check_config(tmp_path, base + f"  {key}: ture\n")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == f"error: {tmp_path / 'bad.yaml'}: {section}.{key} = 'ture': expected true or false", lines


def test_reshard_typo_names_strategies_only_where_fsdp1_takes_one(tmp_path):
    code, lines = check_config(tmp_path, FSDP_V2.replace("2", "1") + "  fsdp_reshard_after_forward: flase\n")
    assert code == 2 and len(lines) == 1, lines
    assert "fsdp_reshard_after_forward = 'flase': expected true or false (under fsdp_version 1 also a sharding " \
           "strategy: FULL_SHARD," in lines[0], lines
    for ok in ("true", "FALSE", "SHARD_GRAD_OP"):  # the spellings that stay accepted
        assert check_config(tmp_path, FSDP_V2.replace("2", "1") + f"  fsdp_reshard_after_forward: {ok}\n")[0] == 0


@pytest.mark.parametrize("key", ["memory_efficient_linear", "stage3_gather_16bit_weights_on_model_save"])
def test_deepspeed_json_true_false_typo_says_true_or_false(tmp_path, key):
    js = json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, key: "ture"}})
    code, lines = check_config(tmp_path, "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: "
                               "ds.json\n", {"ds.json": js})
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].endswith(f"ds.json: zero_optimization.{key} = 'ture': expected true or false"), lines


# ---- 2. a Python without the guide's packages: activate the venv ---------------------------------------------

def venv_advice() -> str:
    return "source .venv/bin/activate" if (REPO / ".venv" / "bin" / "python").exists() else "run make setup first"


@pytest.mark.parametrize("module", ["helpers.train", "helpers.config", "helpers.compare", "helpers.switch",
                                    "helpers.warmup"])
def test_python_outside_the_venv_is_told_to_activate_it(module):
    """-S: this interpreter without site-packages (the venv's included), as /usr/bin/python3 without torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([sys.executable, "-S", "-m", module, "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {sys.executable} lacks the guide's packages (torch, deepspeed, "), lines
    assert venv_advice() in lines[0], lines


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}")
def test_system_python_gets_the_line_not_a_traceback():
    has_torch = subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True).returncode == 0
    if has_torch:
        pytest.skip(f"{SYSTEM_PYTHON} has torch")
    proc = subprocess.run([SYSTEM_PYTHON, "-m", "helpers.train", "--config", FSDP, "--out", "runs/never"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: {SYSTEM_PYTHON} lacks the guide's packages (torch") and \
        venv_advice() in proc.stderr, proc.stderr
    assert not (REPO / "runs" / "never").exists()


def test_the_packages_checked_are_pyprojects():
    deps = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.M | re.S).group(1)
    names = [n.lower() for n in re.findall(r'^\s*"([\w.-]+)', deps, re.M)]
    assert [{"pyyaml": "yaml"}.get(n, n) for n in names] == list(helpers.PACKAGES)
    assert helpers.missing_packages() == []  # this (the venv's) Python has them all


# ---- 3. make lab on every interface: the machine's addresses ---------------------------------------------------

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def lab_urls(tmp_path, ips: str, *args: str) -> tuple[list[str], str]:
    """The hosts of the URLs `make -n lab ARGS` would print (nothing runs), with a `hostname` that answers -I with
    ``ips`` and -f with box.example; and the whole output."""
    fake = tmp_path / "hostname"
    fake.write_text(f'#!/bin/sh\ncase "$1" in -I) echo "{ips}";; -f) echo box.example;; *) echo box;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["make", "-n", "lab", "LAB_TOKEN=t", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return re.findall(r"lab: open http://(\[[^\]]+\]|[^:/\"]+):8888/lab/tree/notebooks/00_launching\.ipynb\?token=t",
                      proc.stdout), proc.stdout


@needs_make
def test_lab_on_all_interfaces_prints_ip_urls_and_no_tunnel(tmp_path):
    hosts, out = lab_urls(tmp_path, "10.1.2.3 192.168.7.9 fd00::5", "LAB_IP=0.0.0.0")
    assert hosts == ["10.1.2.3", "192.168.7.9"], out  # 0.0.0.0 listens on IPv4 only
    assert "ssh -L" not in out and "box" not in out
    hosts, out = lab_urls(tmp_path, "10.1.2.3 fd00::5", "LAB_IP=::")
    assert hosts == ["10.1.2.3", "[fd00::5]"] and "ssh -L" not in out, out
    hosts, out = lab_urls(tmp_path, "", "LAB_IP=0.0.0.0")  # no address: the hostname
    assert hosts == ["box.example"] and "ssh -L" not in out, out


@needs_make
def test_lab_on_loopback_prints_the_tunnel(tmp_path):
    hosts, out = lab_urls(tmp_path, "10.1.2.3")
    assert hosts == ["127.0.0.1"], out
    assert "ssh -L 8888:localhost:8888 USER@THIS_HOST" in out
    hosts, out = lab_urls(tmp_path, "10.1.2.3", "LAB_IP=10.1.2.3")  # one address: that one, no tunnel
    assert hosts == ["10.1.2.3"] and "ssh -L" not in out, out


# ---- 4. a busy --out is refused before the libraries load ----------------------------------------------------

def test_busy_out_is_refused_before_torch_loads(tmp_path):
    from helpers.job.guard import OutDirError, claim_out_dir, refuse_if_busy

    out = tmp_path / "run"
    lock = claim_out_dir(out)  # held by this process, as by a running job
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "helpers.train", "--config", FSDP, "--out",
                               str(out), "--steps", "1"], cwd=REPO, env=job_env(), capture_output=True, text=True,
                              timeout=300)
        refused_s = time.perf_counter() - t0
        with pytest.raises(OutDirError):
            refuse_if_busy(out)
    finally:
        lock.close()
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: --out {out} is in use by a running job (pid {os.getpid()} on "), errors
    assert errors[0].endswith("wait for it to finish or pick another --out")
    assert not re.search(r"\|\s+torch$", proc.stderr, re.M), "torch was imported before the refusal"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, deepspeed"], cwd=REPO, env=job_env(), check=True,
                   capture_output=True, timeout=300)
    imports_s = time.perf_counter() - t0
    assert refused_s < imports_s / 2, (refused_s, imports_s)
    refuse_if_busy(out)  # the job that held it is gone (its lock file stays): not busy
    refuse_if_busy(tmp_path / "nowhere")  # no directory: nothing to say


# ---- 5. more CPU ranks than cores: a note ---------------------------------------------------------------------

def test_more_ranks_than_cores_is_a_note(monkeypatch):
    import torch

    from helpers.job import comm

    (note,) = comm.cpu_share_notes(4, 2)
    assert note.startswith("4 ranks on this node share 2 CPU cores: they take turns, so steps are slower"), note
    assert comm.cpu_share_notes(2, 2) == comm.cpu_share_notes(1, 2) == []
    assert "share 1 CPU core:" in comm.cpu_share_notes(2, 1)[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = comm.cpu_cores()
    assert cores == len(os.sched_getaffinity(0))
    assert comm.check_local_device(0, cores) == [] and comm.check_local_device(0, cores + 1) == \
        comm.cpu_share_notes(cores + 1, cores)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nccl: one GPU per rank, no note
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert comm.check_local_device(0, 8) == []


# ---- 6. the warmup says "already built" for a built op -------------------------------------------------------

def test_warmup_says_already_built():
    def warmup():
        proc = subprocess.run([sys.executable, "-m", "helpers.warmup"], cwd=REPO, env=job_env(), capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    out = warmup()
    if "shared-memory comm op: built in" in out:  # not built before this test: it is now
        out = warmup()
    assert re.search(r"^warmup: DeepSpeed's shared-memory comm op: already built \(loaded in [\d.]+ s\)$", out, re.M), out
    assert "built successfully" not in out and "building" not in out


def test_timed_load_tells_a_build_from_a_load(tmp_path, monkeypatch):
    from helpers.core.internals import extension_build_dir
    from helpers.job.ops import timed_load

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def build(lib):
        def load():
            (tmp_path / "op" / lib).write_bytes(b"")  # what torch's build leaves
            return "module"
        return load

    extension_build_dir("op")  # makes the op's build directory, as torch's build does
    assert re.fullmatch(r"built in \d+ s", timed_load("op", build("op.so"))[1])
    module, said = timed_load("op", lambda: "module")  # the library is there and unchanged: a load
    assert module == "module" and re.fullmatch(r"already built \(loaded in [\d.]+ s\)", said), said
    assert timed_load("op", build("op_v1.so"))[1].startswith("built in ")  # changed sources: a new library


# ---- 7. where pip finds torch: TORCH_INDEX ---------------------------------------------------------------------

def setup_lines(*args: str) -> list[str]:
    """The pip/uv install lines `make setup ARGS` would run, as if pyproject.toml had changed (nothing runs)."""
    proc = subprocess.run(["make", "-n", "-W", "pyproject.toml", "setup", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [ln for ln in proc.stdout.splitlines() if " install " in ln and ("pip" in ln or "uv" in ln)]


@needs_make
def test_torch_index_goes_to_the_torch_install_only():
    index = "https://download.pytorch.org/whl/cpu"
    lines = setup_lines(f"TORCH_INDEX={index}")
    torch_line = [ln for ln in lines if "torch==2.13.0" in ln]
    assert len(torch_line) == 1 and f"--index-url {index} torch==2.13.0" in torch_line[0], lines
    assert all("--index-url" not in ln for ln in lines if ln not in torch_line), lines
    assert not any("--index-url" in ln for ln in setup_lines()), "no TORCH_INDEX: pip's own index"


def test_docs_say_where_pip_finds_torch():
    for page in (REPO / "README.md", REPO / "docs" / "setup.md"):
        text = page.read_text()
        assert "make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text, page
        assert "CUDA build" in text and "pinned CPU build" not in text, page

"""Every offload config runs on CPU, reports where each state lives, and trains like no offload.

One 2-rank, 3-step tiny run per config, shared by the tests (session fixture). Without libaio
the NVMe config is skipped (say why); CI installs it (make setup).
"""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import FSDP, REPO, ZERO3, run_job, summary

from helpers.core.config import load_job_config
from helpers.core.mapping import CATEGORIES
from helpers.job import ops
from helpers.job.observe import offload

CONFIGS = {
    "full_shard": FSDP,
    "full_shard_offload": "launch_configs/fsdp/full_shard_offload.yaml",
    "zero3": ZERO3,
    "zero3_offload_optimizer": "launch_configs/deepspeed/zero3_offload_optimizer.yaml",
    "zero3_offload": "launch_configs/deepspeed/zero3_offload.yaml",
    "zero3_nvme": "launch_configs/deepspeed/zero3_nvme.yaml",
}
NVME_OK, NVME_STATE = ops.aio_status()
STARTED = time.time()  # before this file's jobs
needs_nvme = pytest.mark.skipif(not NVME_OK, reason=f"NVMe offload: {NVME_STATE}")


@pytest.fixture(scope="session")
def offload_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("offload")
    outs = {}
    for name, cfg in CONFIGS.items():
        if name == "zero3_nvme" and not NVME_OK:
            continue
        # the first NVMe job on a machine compiles DeepSpeed's async_io op first (minutes; see offload.build_aio)
        proc = run_job(cfg, base / name, 2, "--model", "tiny", "--steps", "3",
                       timeout=1800 if name == "zero3_nvme" else 600)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"
        outs[name] = summary(base / name)
        outs[name]["out"] = base / name
    return outs


def places(s: dict, cat: str, rank: int) -> set[str]:
    return {loc for loc, n in s["memory_location_bytes"][rank][cat].items() if n}


@pytest.mark.cpu_only("offload steps the optimizer on the host; on a GPU it may round unlike the device step (unverified)")
def test_losses_equal_no_offload(offload_runs):
    base = offload_runs["zero3"]["losses"]
    assert offload_runs["full_shard"]["losses"] == base  # the aligned pair, as without offload
    for name, s in offload_runs.items():
        assert s["status"] == "completed" and len(s["losses"]) == 3, name
        assert s["losses"] == base, (name, s["losses"], base)  # bit for bit


def test_every_run_reports_each_category_by_location(offload_runs):
    for name, s in offload_runs.items():
        assert len(s["memory_location_bytes"]) == 2, name
        for rank in range(2):
            locs = s["memory_location_bytes"][rank]
            assert set(locs) == set(CATEGORIES)
            assert all(set(v) == set(offload.LOCATIONS) for v in locs.values())
            assert offload.totals(locs) == s["memory_bytes"][rank], name
            if "nvme" not in name:
                assert sum(v["disk"] for v in locs.values()) == 0, name
                assert s["swap_buffer_bytes"][rank] == {"params": 0, "optimizer": 0}, name  # no NVMe swapper


def test_fsdp_offload_moves_everything_together(offload_runs):
    plain, off = offload_runs["full_shard"], offload_runs["full_shard_offload"]
    for rank in range(2):
        for cat in ("params", "grads", "optimizer_states"):
            assert places(plain, cat, rank) == {"device"}, cat
            assert places(off, cat, rank) == {"host"}, cat
    assert off["memory_bytes"] == plain["memory_bytes"]  # moved, not changed


def test_deepspeed_offloads_the_optimizer_alone_or_with_params(offload_runs):
    plain, opt, both = (offload_runs[k] for k in ("zero3", "zero3_offload_optimizer", "zero3_offload"))
    for rank in range(2):
        for cat in CATEGORIES:
            assert places(plain, cat, rank) == {"device"}, cat
        assert places(opt, "params", rank) == {"device"}  # params stay
        for cat in ("optimizer_states", "master_params", "grads"):
            assert places(opt, cat, rank) == {"host"} == places(both, cat, rank), cat
        params = both["memory_location_bytes"][rank]["params"]
        # partitions on the host; ZeRO-3's "persistent" small params stay whole next to the compute
        assert params["host"] > 0 and params["device"] > 0, params
        for cat in ("optimizer_states", "master_params"):
            assert opt["memory_bytes"][rank][cat] == plain["memory_bytes"][rank][cat]
    # the host optimizer keeps an fp32 copy of the gradient partition: 4 bytes per bf16 grad's 2
    extra = opt["memory_bytes"][0]["grads"] - plain["memory_bytes"][0]["grads"]
    assert extra == pytest.approx(2 * plain["memory_bytes"][0]["grads"], rel=0.01)


@needs_nvme
def test_nvme_states_are_measured_on_disk(offload_runs):
    nvme, plain = offload_runs["zero3_nvme"], offload_runs["zero3"]
    swap = nvme["out"] / "nvme_swap" / "zero_stage_3"
    for rank in range(2):
        files = list(swap.glob(f"*/rank{rank}/*.swp"))
        assert files, f"no swap files for rank {rank} under {swap}"
        on_disk = sum(f.stat().st_size for f in files)
        assert sum(v["disk"] for v in nvme["memory_location_bytes"][rank].values()) == on_disk
        assert places(nvme, "master_params", rank) == {"disk"}
        states = nvme["memory_location_bytes"][rank]["optimizer_states"]  # Adam's step counter stays in memory
        assert states["disk"] > 1000 * states["host"] and states["device"] == 0, states
        for cat in ("optimizer_states", "master_params"):
            # the same tensors as in memory, padded to the aio block size at most
            assert plain["memory_bytes"][rank][cat] <= nvme["memory_bytes"][rank][cat]
            assert nvme["memory_bytes"][rank][cat] < plain["memory_bytes"][rank][cat] + 2**20
        # tiny's parameter partitions are all under 1 MiB (the aio block): DeepSpeed keeps them in memory
        assert "disk" not in places(nvme, "params", rank)
        # the fp32 gradient copy made at the end of backward: tiny's pieces are all under 1 MiB too, so they
        # wait in host memory for the step, as many bytes as the CPU-offloaded optimizer's gradient buffer
        opt = offload_runs["zero3_offload_optimizer"]
        assert nvme["memory_location_bytes"][rank]["grads"] == opt["memory_location_bytes"][rank]["grads"]
    cfg = json.loads((nvme["out"] / "config.json").read_text())
    # the param swapper's page-locked buffers (buffer_count x buffer_size bf16 elements, each rounded up to
    # the I/O alignment) plus the optimizer swapper's: allocated whether or not a param is swapped
    param_swap = cfg["deepspeed"]["json"]["zero_optimization"]["offload_param"]
    asked = param_swap["buffer_count"] * param_swap["buffer_size"] * 2
    for rank in range(2):
        held = nvme["swap_buffer_bytes"][rank]
        assert asked <= held["params"] < asked + param_swap["buffer_count"] * 2**20, (held, param_swap)
        assert held["optimizer"] > 0, held
    paths = {cfg["deepspeed"]["json"]["zero_optimization"][k]["nvme_path"]
             for k in ("offload_param", "offload_optimizer")}
    # relative path: on the node's own disk, linked from the run directory
    assert paths == {str(offload.local_swap_dir(nvme["out"], "nvme_swap"))}
    assert (nvme["out"] / "nvme_swap").is_symlink() and (nvme["out"] / "nvme_swap").resolve() == Path(paths.pop())


@needs_nvme
def test_deepspeed_swaps_with_our_async_io_built_as_one_file_without_debug_info(offload_runs):
    """The NVMe job above loaded (or built) helpers.job.observe.offload's build of async_io; DeepSpeed compiled no other."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from helpers.core.internals import extension_build_dir

    ours = ops.load_aio()
    assert AsyncIOBuilder().load(verbose=False) is ours  # what DeepSpeed's swappers get in a process that loaded ours
    built = Path(extension_build_dir(ops.AIO_OP))
    cflags = next(line for line in (built / "build.ninja").read_text().splitlines() if line.startswith("cflags ="))
    assert "-O0" in cflags.split() and "-g" not in cflags.split(), cflags
    objects = sorted(f.name for f in built.glob("*.o"))  # py_lib's nine sources as one, common's three alone
    assert objects == sorted(["_all_py_lib.o", "deepspeed_aio_common.o", "deepspeed_aio_types.o",
                              "deepspeed_aio_utils.o"]), objects
    theirs = Path(extension_build_dir(AsyncIOBuilder.NAME))
    touched = [f.name for f in theirs.glob("*") if f.stat().st_mtime >= STARTED]
    assert not touched, f"a job built DeepSpeed's own {AsyncIOBuilder.NAME} op: {touched}"


def test_swap_file_names_map_to_categories(tmp_path):
    rank = tmp_path / "zero_stage_3"
    names = {"bfloat16params/rank0/12_param.tensor.swp": "params",
             "optimizer/rank0/0_11.tensor.swp": "master_params",
             "optimizer/rank0/exp_avg-0_11.tensor.swp": "optimizer_states",
             "optimizer/rank0/exp_avg_sq-0_11.tensor.swp": "optimizer_states",
             "optimizer/rank0/0_11_gradient_0_4096.tensor.swp": "grads",
             "optimizer/rank1/0_11.tensor.swp": None}  # another rank's
    for name, size in zip(names, range(1, 7), strict=True):
        (rank / name).parent.mkdir(parents=True, exist_ok=True)
        (rank / name).write_bytes(b"x" * size)
    ds_json = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    assert offload.swap_file_bytes(ds_json, 0) == {"params": 1, "grads": 5, "optimizer_states": 3 + 4,
                                                   "master_params": 2}


def test_nvme_without_a_path_is_refused_before_launch(tmp_path):
    js = json.loads((REPO / "launch_configs/deepspeed/zero3_nvme.json").read_text())
    del js["zero_optimization"]["offload_param"]["nvme_path"]
    (tmp_path / "nvme.json").write_text(json.dumps(js))
    (tmp_path / "nvme.yaml").write_text(
        f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'nvme.json'}\n")
    proc = run_job(str(tmp_path / "nvme.yaml"), tmp_path / "out", 0, "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error:")
    assert "offload_param.device = nvme needs an nvme_path" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_offload_configs_parse():
    for name, cfg in CONFIGS.items():
        job = load_job_config(str(REPO / cfg), world_size=2)
        if job.backend == "fsdp":
            assert job.fsdp.offload_params == name.endswith("offload")
        else:
            ds = job.deepspeed
            want = {"zero3": ("none", "none"), "zero3_offload_optimizer": ("cpu", "none"),
                    "zero3_offload": ("cpu", "cpu"), "zero3_nvme": ("nvme", "nvme")}[name]
            assert (ds.offload_optimizer_device, ds.offload_param_device) == want


def test_a_param_swap_file_counts_only_while_its_partition_is_on_disk(tmp_path):
    # ZeRO-3 swaps big partitions out while building the model, then (offload_param.max_in_cpu allowing)
    # reads them back into a host buffer for good and leaves the file: such a file is not state on disk
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    folder = tmp_path / "zero_stage_3" / "bfloat16params" / "rank0"
    folder.mkdir(parents=True)
    (folder / "7_param.tensor.swp").write_bytes(b"x" * 4096)
    (folder / "9_param.tensor.swp").write_bytes(b"x" * 1024)
    assert offload.swap_file_bytes(cfg, 0)["params"] == 5120  # every file, when nothing says which are live
    assert offload.swap_file_bytes(cfg, 0, params_on_disk={9})["params"] == 1024
    assert offload.swap_file_bytes(cfg, 0, params_on_disk=set())["params"] == 0
    assert offload.swap_file_bytes(cfg, 1, params_on_disk={7, 9})["params"] == 0  # another rank's files


def test_a_relative_nvme_path_swaps_on_the_nodes_own_disk(tmp_path, monkeypatch):
    """Not under --out (on a cluster a shared filesystem): under the system temp dir, one per run directory, an
    earlier run's files removed by the node's first rank; the run directory links to it; a note says where."""
    import tempfile

    monkeypatch.setattr(offload, "aio_status", lambda: (True, ""))
    monkeypatch.setattr(offload, "build_aio", lambda: [])
    out = tmp_path / "run"
    job = load_job_config(str(REPO / CONFIGS["zero3_nvme"]), world_size=2)
    home = offload.local_swap_dir(str(out), "nvme_swap")
    (home / "zero_stage_3").mkdir(parents=True)
    (home / "zero_stage_3" / "old.swp").write_bytes(b"x")  # an earlier run's
    notes = offload.prepare(job, str(out), local_rank=0)
    zo = job.deepspeed.json["zero_optimization"]
    assert zo["offload_param"]["nvme_path"] == zo["offload_optimizer"]["nvme_path"] == str(home)
    assert home.is_relative_to(tempfile.gettempdir()) and not home.is_relative_to(tmp_path)
    assert not home.exists()  # cleared
    assert notes[0].startswith(f"offload_param.nvme_path 'nvme_swap' is relative: swapping to {home} on each "
                               "node's own disk")
    assert offload.local_swap_dir(str(tmp_path / "other"), "nvme_swap") != home  # per run directory
    out.mkdir()
    offload.link_swap_dirs(job, str(out))
    assert (out / "nvme_swap").is_symlink() and os.readlink(out / "nvme_swap") == str(home)
    other = load_job_config(str(REPO / CONFIGS["zero3_nvme"]), world_size=2)
    home.mkdir(parents=True)
    offload.prepare(other, str(out), local_rank=1)  # not the node's first rank: leaves the directory alone
    assert home.exists()
    shutil.rmtree(home.parent)

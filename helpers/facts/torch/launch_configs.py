"""torch (2.13.0) facts the guide states about the README and the launch configs' comments.

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from unittest import mock

from .. import fact, gpu_fact

V = "2.13.0"


@fact("torch.chrome_trace_json",
      "torch.profiler's export_chrome_trace writes a Chrome trace-event JSON file (a traceEvents list), the "
      "format ui.perfetto.dev opens.",
      "torch", V, "profiler/profiler.py: profile.export_chrome_trace")
def _trace():
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents")
    return isinstance(events, list) and len(events) > 0, {"traceEvents": len(events or [])}


class _Calls:
    """An object whose unpickling calls a function (here a harmless one)."""

    def __reduce__(self):
        return (os.path.join, ("called", "by", "pickle"))


@fact("torch.pt_is_pickle",
      "A torch.save file is a zip holding a pickle (data.pkl); torch.load(weights_only=False) runs whatever "
      "function the pickle names, weights_only=True refuses it.",
      "torch", V, "serialization.py: _save, load, _weights_only_unpickler")
def _pickle():
    import torch

    buf = io.BytesIO()
    torch.save({"x": _Calls()}, buf)
    names = zipfile.ZipFile(io.BytesIO(buf.getvalue())).namelist()
    full = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)["x"]
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        refused = False
    except pickle.UnpicklingError:
        refused = True
    ok = any(n.endswith("data.pkl") for n in names) and full == os.path.join("called", "by", "pickle") and refused
    return ok, {"data.pkl": any(n.endswith("data.pkl") for n in names), "weights_only=False ran": full,
                "weights_only=True refused": refused}


@fact("torch.dcp_metadata_plain_pickle",
      "torch.distributed.checkpoint reads a checkpoint's .metadata file with a plain pickle.load.",
      "torch", V, "distributed/checkpoint/filesystem.py: FileSystemReader.read_metadata")
def _dcp_meta():
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    with tempfile.TemporaryDirectory() as d:
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
        with mock.patch.object(filesystem.pickle, "load", wraps=pickle.load) as spy:
            meta = dcp.FileSystemReader(d).read_metadata()
    return spy.called, {"pickle.load calls": spy.call_count, "metadata": type(meta).__name__}


@fact("torch.tcpstore_listens_all_interfaces",
      "torch's TCPStore server (torchrun's rendezvous store) listens on all interfaces, whatever host it is "
      "given (127.0.0.1 here).",
      "torch", V, "distributed TCPStore (C++ TCPStoreBackend); distributed/elastic/rendezvous/"
      "c10d_rendezvous_backend.py: _create_tcp_store")
def _tcpstore():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    port, local = store.port, []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for r in rows:
            f = r.split()
            addr, p = f[1].rsplit(":", 1)
            if int(p, 16) == port and f[3] == "0A":  # LISTEN
                local.append(addr)
    del store
    wildcard = bool(local) and all(set(a) == {"0"} for a in local)
    return wildcard, {"port": port, "listening on": "/".join(local) or "not found", "wildcard": wildcard}


@fact("torch.gloo_socket_ifname",
      "gloo takes its network interface from GLOO_SOCKET_IFNAME: a gloo group with an interface that does not "
      "exist fails to start, naming it.",
      "torch", V, "third_party/gloo transport/tcp/device.cc; ProcessGroupGloo (C++)")
def _ifname():
    code = ("import torch.distributed as d\n"
            "d.init_process_group('gloo', store=d.HashStore(), rank=0, world_size=1)\n")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="nosuchif0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    named = "nosuchif0" in p.stderr
    return p.returncode != 0 and named, {"exit": p.returncode, "names the interface": named}


@fact("torch.checkpoint_saves_inputs_only",
      "Non-reentrant activation checkpointing keeps only the checkpointed block's inputs for backward (the rest "
      "is recomputed).",
      "torch", V, "utils/checkpoint.py: checkpoint (use_reentrant=False), _checkpoint_hook")
def _ckpt_inputs():
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def block(x):
        return torch.relu(lin2(torch.relu(lin1(x))))

    def saved(run):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            run()
        return shapes

    x = torch.randn(8, 64, requires_grad=True)
    with_ckpt = saved(lambda: checkpoint(block, x, use_reentrant=False))
    without = saved(lambda: block(x))
    return with_ckpt == [(8, 64)] and len(without) > 1, {"saved with checkpoint": len(with_ckpt),
                                                        "saved without": len(without)}


gpu_fact("torch.nccl_needs_device_tensors",
         "nccl collectives take tensors on the process group's GPU only (gloo takes CPU tensors); not checked here.",
         "torch", V, "distributed ProcessGroupNCCL (C++)", "needs an nccl group, that is a GPU")

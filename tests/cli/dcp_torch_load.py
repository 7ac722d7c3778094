#!/usr/bin/env python3
"""Loads a DCP directory written by `reshard convert --format dcp` with PyTorch's own
torch.distributed.checkpoint.load, into DTensor state dicts on a mesh of N gloo processes
(every tensor Shard(0) over the mesh, or Shard(1) where it has a second dim and --dim 1), and
compares every value with a safetensors file of full tensors under our names (`<param>` and
`<param>/<state>`), which PyTorch wrote independently. Exit 0 when every key of the directory
loads and equals its expected tensor; prints what differs otherwise.

  python3 dcp_torch_load.py DIR EXPECTED.safetensors --procs 4 [--dim 1]
  python3 dcp_torch_load.py DIR REFERENCE_DCP_DIR --procs 2

With a DCP directory as the second argument (one PyTorch wrote, e.g. a torchtitan checkpoint),
every tensor key of DIR is compared with the same key there, loaded in one process.

Needs torch and safetensors (CI has neither; tests/cli/dcp_cli_test.cc skips it there).
"""
import argparse
import os
import pickle
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def our_name(key):
    if key.startswith("model."):
        return key[len("model."):]
    if key.startswith("optim.state."):
        rest = key[len("optim.state."):]
        param, state = rest.rsplit(".", 1)
        return param + "/" + state
    raise ValueError(key)


def init_gloo(rank, procs, port):
    """Joins the gloo group of `procs` processes on 127.0.0.1:`port`; returns a 1-D CPU mesh."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=procs)
    return init_device_mesh("cpu", (procs,))


def spawn_gloo(run, args, procs):
    """Runs run(rank, args, port, queue) in `procs` spawned processes; returns what rank 0 put."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mp.get_context("spawn").Queue()
    mp.spawn(run, args=(args, port, result), nprocs=procs, join=True)
    return result.get()


def run(rank, args, port, result):
    mesh = init_gloo(rank, args.procs, port)
    with open(os.path.join(args.dir, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    reference = None
    if os.path.isdir(args.expected):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        reference = {}
        path = os.path.join(args.tmp, "reference.pt")
        if rank == 0:
            dcp_to_torch_save(args.expected, path)
        dist.barrier()

        def flatten(d, prefix=""):
            for k, v in d.items():
                if isinstance(v, dict):
                    flatten(v, prefix + str(k) + ".")
                else:
                    reference[prefix + str(k)] = v
        flatten(torch.load(path, weights_only=False))
        expected = {}
    else:
        expected = load_file(args.expected)
    state, full = {}, {}
    for key, md in meta.state_dict_metadata.items():
        if not hasattr(md, "size"):  # a torch.save'd value (param groups): titan_resume.py checks those
            continue
        dtype, size = md.properties.dtype, tuple(md.size)
        dim = args.dim if len(size) > args.dim else 0
        blank = torch.full(size, float("nan") if dtype.is_floating_point else -1, dtype=dtype)
        state[key] = distribute_tensor(blank, mesh, [Shard(dim)]) if len(size) > 0 else blank
    dcp.load(state, checkpoint_id=args.dir)
    bad = []
    for key, t in state.items():
        got = t.full_tensor() if hasattr(t, "full_tensor") else t
        if reference is not None:
            want = reference.get(key)
            ok = isinstance(want, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
            if not ok:
                bad.append(key)
            continue
        name = our_name(key)
        if key.endswith(".step"):
            want = expected.get("optimizer.step")
            ok = want is not None and float(got) == float(want)
        else:
            want = expected.get(name)
            ok = want is not None and got.dtype == want.dtype and torch.equal(got, want)
        if not ok:
            bad.append(key)
    dist.destroy_process_group()
    if rank == 0:
        result.put((len(state), bad))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("expected")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--dim", type=int, default=0)
    args = ap.parse_args()
    import tempfile
    args.tmp = tempfile.mkdtemp()
    n, bad = spawn_gloo(run, args, args.procs)
    print(f"dcp.load on {args.procs} gloo processes (Shard({args.dim})): {n} keys, {len(bad)} differ")
    for k in bad:
        print("  differs:", k)
    sys.exit(1 if bad or n == 0 else 0)


if __name__ == "__main__":
    main()

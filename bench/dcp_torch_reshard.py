#!/usr/bin/env python3
"""PyTorch's own reshard of a DCP directory, for bench/dcp_write.sh: N gloo processes load every
key of SRC with torch.distributed.checkpoint.load into DTensors sharded on dim 0 over a mesh of
N (a different layout from the one SRC was written at), then save them with dcp.save to DST.
Prints one line: "load_s save_s" (rank 0's wall clock for each phase).

  python3 dcp_torch_reshard.py SRC DST --procs N
"""
import argparse
import os
import pickle
import socket
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def run(rank, args, port, result):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs)
    mesh = init_device_mesh("cpu", (args.procs,))
    with open(os.path.join(args.src, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    state = {}
    for key, md in meta.state_dict_metadata.items():
        if not hasattr(md, "size"):
            continue
        blank = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        state[key] = distribute_tensor(blank, mesh, [Shard(0)]) if len(md.size) > 0 else blank
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=args.src)
    dist.barrier()
    t1 = time.perf_counter()
    dcp.save(state, checkpoint_id=args.dst)
    dist.barrier()
    t2 = time.perf_counter()
    dist.destroy_process_group()
    if rank == 0:
        result.put((t1 - t0, t2 - t1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    mp.spawn(run, args=(args, port, result), nprocs=args.procs, join=True)
    load_s, save_s = result.get()
    print(f"{load_s:.3f} {save_s:.3f}")


if __name__ == "__main__":
    main()

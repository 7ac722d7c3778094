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
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cli"))
from dcp_torch_load import init_gloo, spawn_gloo  # noqa: E402  (the gloo start-up the tests use)


def run(rank, args, port, result):
    mesh = init_gloo(rank, args.procs, port)
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
    load_s, save_s = spawn_gloo(run, args, args.procs)
    print(f"{load_s:.3f} {save_s:.3f}")


if __name__ == "__main__":
    main()

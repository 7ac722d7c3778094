#!/usr/bin/env python3
"""Resumes from a DCP directory written by `reshard convert --format dcp` with torchtitan's names
the way torchtitan's CheckpointManager does, and checks every value.

    python3 tests/cli/titan_resume.py OURS TITAN_FIXTURE --lr LR --wd WD [--procs N]

N gloo processes (default 2) build a module tree with torchtitan's FQNs (those of the
fixture's tensors, as DTensors sharded on dim 0: FSDP2 style) and a torch.optim.AdamW over it,
take the optimizer's state dict flattened as torchtitan flattens it
(get_optimizer_state_dict(..., flatten_optimizer_state_dict=True): `optimizer.state.<fqn>.<s>`
and `optimizer.param_groups.<fqn>.<hyper-parameter>`), `dcp.load` OURS into it and restore it
with set_optimizer_state_dict. The same is done with TITAN_FIXTURE (written by PyTorch from a
real AdamW step). Every parameter and optimizer state (exp_avg, exp_avg_sq, step) must be
equal between the two, and the restored param group must hold lr LR, betas (0.9, 0.95) and
weight decay WD (the first parameter, a matrix, gives the group its values). Prints "OK <n>
values" and exits 0 when all agree. Without the param groups in OURS, dcp.load fails naming the
missing keys.
"""
import argparse
import os
import pickle
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_torch_load import init_gloo, spawn_gloo  # noqa: E402


class Node(nn.Module):
    pass


def restore(path, mesh, keys):
    root = Node()
    for name, md in keys.items():
        *parents, leaf = name.split(".")
        mod = root
        for part in parents:
            if not hasattr(mod, part):
                mod.add_module(part, Node())
            mod = getattr(mod, part)
        blank = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
        mod.register_parameter(leaf, nn.Parameter(distribute_tensor(blank, mesh, [Shard(0)])))
    opt = torch.optim.AdamW(root.parameters(), lr=0.0, betas=(0.9, 0.95), weight_decay=0.1)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {name: p for name, p in root.named_parameters()}
    state["optimizer"] = get_optimizer_state_dict(root, opt, options=flat)
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(root, opt, state["optimizer"], options=flat)
    return root, opt


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(rank, args, port, result):
    mesh = init_gloo(rank, args.procs, port)
    with open(os.path.join(args.titan, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    keys = {k: md for k, md in meta.state_dict_metadata.items() if not k.startswith("optimizer.")}
    ours, opt_ours = restore(args.ours, mesh, keys)
    ref, opt_ref = restore(args.titan, mesh, keys)
    bad, n = [], 0
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        q = ref_params[name]
        n += 1
        if not torch.equal(full(p.data), full(q.data)):
            bad.append(name)
        for s in ("exp_avg", "exp_avg_sq", "step"):
            n += 1
            if not torch.equal(full(opt_ours.state[p][s]), full(opt_ref.state[q][s])):
                bad.append(f"{name}/{s}")
    g = opt_ours.param_groups[0]
    if abs(g["lr"] - args.lr) > 1e-12 or tuple(g["betas"]) != (0.9, 0.95) or abs(g["weight_decay"] - args.wd) > 1e-12:
        bad.append(f"param group {dict((k, v) for k, v in g.items() if k != 'params')}")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        result.put((n, bad))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("titan")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--wd", type=float, required=True)
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    n, bad = spawn_gloo(run, args, args.procs)
    if bad:
        print("FAIL " + "\n".join(bad))
        return 1
    print(f"OK {n} values")
    return 0


if __name__ == "__main__":
    sys.exit(main())

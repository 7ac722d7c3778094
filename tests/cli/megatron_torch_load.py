#!/usr/bin/env python3
"""Loads a `torch_dist` checkpoint written by `reshard convert --format torch_dist` with
Megatron-Core itself, at another tensor / expert parallelism, and checks every value.

    python3 tests/cli/megatron_torch_load.py KIND SRC WORK TP EP

KIND is one of the Megatron fixtures of tests/fixtures/megatron (make_fixtures.py builds its
model), SRC the directory `convert --format torch_dist --megatron-spec local` wrote from that
fixture. Run where torch and megatron-core are installed (the C++ test that calls it skips
otherwise). Three steps, each by Megatron-Core's own code:

 1. TP·EP gloo processes build the fixture's GPTModel (local layer spec) at tensor parallel TP
    and expert parallel EP, ask `dist_checkpointing.load` for the model and for the distributed
    optimizer's fully_reshardable states (`optimizer.state.<param|exp_avg|exp_avg_sq>.<key>`,
    made with make_sharded_optimizer_tensor), load common.pt (`load_common_state_dict`:
    torch.load with weights_only, so only allowlisted classes) and check its iteration, args and
    the optimizer's param groups and step; then save what they loaded with
    `dist_checkpointing.save` into WORK/resaved.
 2. One process loads WORK/resaved at tensor and expert parallel 1 (Megatron reshards, SwiGLU
    halves and grouped QKV rows included) and maps the tensors to our names
    (make_fixtures.our_names).
 3. Every tensor is compared with the fixture's expected.safetensors, bit for bit: parameters,
    exp_avg, exp_avg_sq, and `param` against our master weights (or the parameter itself for
    f32 parameters without master weights).

Prints "OK <n> tensors" and exits 0 when every value is equal.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures", "megatron"))
import make_fixtures as fx  # noqa: E402

STATES = ("param", "exp_avg", "exp_avg_sq")


def init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    fx.patch_cpu()


def optimizer_request(model, model_sd):
    """Zero holders per parameter and state, and their sharded requests."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    by_data = fx.sharded_by_data(model_sd)
    holders, request = {}, {}
    for n, p in model.named_parameters():
        for st in STATES:
            h = torch.zeros(p.shape, dtype=torch.float32)
            holders[(n, st)] = h
            request[f"{n}.{st}"] = make_sharded_optimizer_tensor(by_data[id(p)], h, prefix=f"optimizer.state.{st}")
    return holders, request


def load(kind, tp, ep, src):
    """The fixture's GPTModel at tp / ep and its optimizer states, loaded from src by Megatron-Core."""
    from megatron.core import dist_checkpointing
    model = fx.build(kind, tp=tp, ep=ep)
    model_sd = model.sharded_state_dict()
    holders, request = optimizer_request(model, model_sd)
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": request}, src)
    model.load_state_dict(loaded["model"], strict=False)
    for key in request:
        n, st = key.rsplit(".", 1)
        holders[(n, st)].copy_(loaded["optimizer"][key])
    return model, holders


def load_and_resave(rank, world, port, kind, src, dst, tp, ep, failures_path):
    init(rank, world, port)
    from megatron.core import dist_checkpointing
    model, holders = load(kind, tp, ep, src)
    common = dist_checkpointing.load_common_state_dict(src)
    problems = []
    step = common.get("iteration")
    if not isinstance(step, int) or step <= 0:
        problems.append(f"iteration {step!r}")
    if common.get("checkpoint_version") != 3.0:
        problems.append(f"checkpoint_version {common.get('checkpoint_version')!r}")
    args = common.get("args")
    if args is None or args.num_layers != fx.L or args.hidden_size != fx.D or args.num_experts != fx.E:
        problems.append(f"args {args!r}")
    opt = common.get("optimizer", {})
    optimizers = [opt] if "optimizer" in opt else [opt[i] for i in sorted(opt)]
    for o in optimizers:
        if o.get("param_state_sharding_type") != "fully_reshardable":
            problems.append(f"param_state_sharding_type {o.get('param_state_sharding_type')!r}")
        for g in o["optimizer"]["param_groups"]:
            for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr"):
                if k not in g:
                    problems.append(f"param group without {k}")
            if g.get("step") != step:
                problems.append(f"param group step {g.get('step')!r}, iteration {step!r}")
    meta = common.get("content_metadata", {})
    if meta.get("distrib_optim_sharding_type") != "fully_reshardable":
        problems.append(f"content_metadata {meta!r}")
    with open(f"{failures_path}.{rank}", "w") as fh:
        fh.write("\n".join(problems))
    # Save what was loaded, as Megatron-Core writes it, for the reference load.
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    model_sd = model.sharded_state_dict()
    by_data = fx.sharded_by_data(model_sd)
    opt_sd = {}
    for i, (n, p) in enumerate(model.named_parameters()):
        for st in STATES:
            opt_sd[f"{i}.{st}"] = make_sharded_optimizer_tensor(by_data[id(p)], holders[(n, st)],
                                                                prefix=f"optimizer.state.{st}")
    dist_checkpointing.save({"model": model_sd, "optimizer": {"param_state": opt_sd}, "iteration": step}, dst)
    dist.barrier()
    dist.destroy_process_group()


def reference(_rank, kind, src, port, out):
    init(0, 1, port)
    model, holders = load(kind, 1, 1, src)
    mla = bool(fx.FIXTURES[kind].get("mla"))
    tensors = fx.our_names({n: t.detach() for n, t in model.state_dict().items()
                            if not n.endswith("_extra_state") and not n.endswith("local_tokens_per_expert")}, mla)
    named = dict(model.named_parameters())
    for st in STATES:
        for name, t in fx.our_names({n: holders[(n, st)] for n in named}, mla).items():
            tensors[f"{name}/{st}"] = t
    torch.save(tensors, out)
    dist.destroy_process_group()


def main():
    kind, src, work, tp, ep = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    from safetensors.torch import load_file
    import megatron.core  # noqa: F401  (registers the classes common.pt may hold)
    world = max(tp, ep)
    resaved = os.path.join(work, "resaved")
    os.makedirs(resaved, exist_ok=True)
    failures_path = os.path.join(work, "failures")
    mp.spawn(load_and_resave, args=(world, fx.free_port(), kind, src, resaved, tp, ep, failures_path), nprocs=world)
    failures = []
    for r in range(world):
        with open(f"{failures_path}.{r}") as fh:
            failures += [line for line in fh.read().split("\n") if line]
    if failures:
        print("FAIL common.pt: " + "; ".join(sorted(set(failures))))
        return 1
    got_path = os.path.join(work, "reference.pt")
    mp.spawn(reference, args=(kind, resaved, fx.free_port(), got_path), nprocs=1)
    got = torch.load(got_path)
    expected = load_file(os.path.join(HERE, "..", "fixtures", "megatron", kind, "expected.safetensors"))
    bad, n = [], 0
    for name, t in got.items():
        if name.endswith("/param"):
            base = name[: -len("/param")]
            want = expected.get(base + "/master", expected.get(base))
            want = want.float() if want is not None else None
        else:
            want = expected.get(name)
        if want is None:
            bad.append(f"{name}: not in expected.safetensors")
            continue
        n += 1
        if want.shape != t.shape or want.dtype != t.dtype or not torch.equal(want, t):
            bad.append(f"{name}: {tuple(t.shape)} {t.dtype} differs from {tuple(want.shape)} {want.dtype}")
    # Every expected tensor was loaded (states the fixture has, under Megatron's name for them).
    for name in expected:
        key = name.replace("/master", "/param")
        if key not in got:
            bad.append(f"{name}: not loaded")
    if bad:
        print("FAIL " + "\n".join(bad))
        return 1
    print(f"OK {n} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

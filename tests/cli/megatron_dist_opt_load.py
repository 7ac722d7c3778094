#!/usr/bin/env python3
"""Loads a dp_reshardable checkpoint written by `reshard convert --format torch_dist
--megatron-optimizer dp_reshardable` into Megatron-Core 0.16.1's own model, DDP and
DistributedOptimizer at the layout it was written for, then saves what was loaded again with
Megatron's fully_reshardable form, which tests/cli/megatron_dist_opt_cli_test.cc reads back and
compares with the source (run only where torch and megatron-core are installed:
RS_TORCH_PYTHON).

    MEGATRON_LAYOUT=tp,pp,ep,world python3 megatron_dist_opt_load.py FIXTURE CHECKPOINT OUT

FIXTURE names the model of tests/fixtures/megatron/make_dp_reshardable.py (whose builders and
CPU stand-ins this reuses); the DDP settings are the checkpoint's recorded args.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron"))
import make_dp_reshardable as mk  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def load_rank(rank, world, port, kind, src, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import faulthandler
    faulthandler.dump_traceback_later(300, exit=True)
    mk.patch_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    f = mk.FIXTURES[kind]
    args = load_common_state_dict(src)["args"]
    cfg, model = mk.build(f)
    bf16 = f["dtype"] == torch.bfloat16
    gpt = model
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=args.overlap_grad_reduce,
                                            bucket_size=args.ddp_bucket_size, grad_reduce_in_fp32=bf16)
    if bf16:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, bf16=bf16, params_dtype=f["dtype"],
                              use_distributed_optimizer=True, clip_grad=0.0)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    # A fresh optimizer has no state to load into (its state_dict() needs the step): one step on
    # zero gradients makes it, as a resumed Megatron-LM run's first iteration would.
    for p in ddp.module.parameters():
        p.main_grad.zero_()
    optimizer.step()
    meta = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False}
    model_sd = gpt.sharded_state_dict(metadata=meta)
    state = {"model": model_sd,
             "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=meta)}
    loaded = dist_checkpointing.load(state, src)
    with torch.no_grad():  # f32 runs' main params are views of the parameters
        gpt.load_state_dict(loaded["model"], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
    meta["distrib_optim_sharding_type"] = "fully_reshardable"
    model_sd = gpt.sharded_state_dict(metadata=meta)
    saved = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=meta),
             "iteration": 0, "checkpoint_version": 3.0, "args": args}
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(saved, out, content_metadata=meta)
    dist.barrier()
    dist.destroy_process_group()


def main():
    kind, src, out = sys.argv[1:4]
    mp.spawn(load_rank, args=(mk.WORLD, mk.free_port(), kind, src, out), nprocs=mk.WORLD)


if __name__ == "__main__":
    main()

# Writes the two Megatron-style common.pt seeds of fuzz/corpus/torch_save/ that the fixtures lack:
# an argparse Namespace under `args` (Megatron-LM stores its arguments there) with the step in the
# distributed optimizer's param_groups, and with a one-element `common_step` tensor. Made with
# torch 2.15 (any torch that writes the zip format will do):
#   python fuzz/make_torch_save_seeds.py fuzz/corpus/torch_save
import argparse
import sys

import torch

out = sys.argv[1]
ns = argparse.Namespace(num_layers=2, hidden_size=64, seq_length=128, bf16=True, moe_router_topk=2)
groups = [{"step": 7, "lr": 1e-3, "params": [0, 1]}, {"step": 7, "lr": 1e-3, "params": [2]}]
torch.save({"args": ns, "iteration": 7, "optimizer": {"optimizer": {"param_groups": groups}}},
           f"{out}/distributed_optimizer_step.pt")
torch.save({"args": ns, "iteration": 3, "optimizer": {"optimizer": {"state": {"common_step": torch.tensor([3])}}}},
           f"{out}/common_step_tensor.pt")

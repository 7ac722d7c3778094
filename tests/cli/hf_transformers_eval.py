#!/usr/bin/env python3
"""transformers' own forward pass as the reference for `reshard eval`: loads a Hugging Face
directory with AutoModelForCausalLM.from_pretrained (float32, CPU) and prints, as JSON, the
eval number of train/MODEL.md section 9 -- the mean next-byte cross-entropy over the first N
windows of S bytes of a file, each window its own batch-1 forward pass -- and each window's
cross-entropy.

  python3 hf_transformers_eval.py HF_DIR DATA_FILE --seq-len S [--windows N]

Needs torch and transformers (not installed by the test set-up: the tests that call it skip
without them).
"""
import argparse
import json
import math

import torch
import transformers
from transformers import AutoModelForCausalLM


def windows(data, seq_len, count):
    total = (len(data) - 1) // seq_len
    count = total if count == 0 else min(count, total)
    for w in range(count):
        chunk = data[w * seq_len:(w + 1) * seq_len + 1]
        yield list(chunk[:-1]), list(chunk[1:])


def evaluate(model, data, seq_len, count):
    per_window = []
    with torch.no_grad():
        for inputs, targets in windows(data, seq_len, count):
            ids = torch.tensor([inputs], dtype=torch.long)
            logits = model(input_ids=ids).logits[0].to(torch.float64)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits[torch.arange(len(targets)), torch.tensor(targets)]
            per_window.append(float((lse - picked).mean()))
    return per_window


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("data")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--windows", type=int, default=0)
    a = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32)
    model.eval()
    data = open(a.data, "rb").read()
    per_window = evaluate(model, data, a.seq_len, a.windows)
    mean = sum(per_window) / len(per_window)
    assert math.isfinite(mean)
    print(json.dumps({"mean_ce": mean, "windows": per_window}))


if __name__ == "__main__":
    main()

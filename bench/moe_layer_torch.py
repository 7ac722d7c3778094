"""One MoE layer forward + backward in PyTorch eager on the CPU, against bench_moe_layer (ours)
in the same run: issue 32's comparison.

    python bench/moe_layer_torch.py [--build build] [--tokens 4096] [--d 512] [--experts 16]
                                    [--k 2] [--ffn 512] [--reps 5] [--threads 0]

Two PyTorch implementations of the same block (softmax router, top-k, gate weights as chosen,
SwiGLU experts w2(silu(w1 x) * w3 x), weighted combine), fwd+bwd through every weight:
  - "hf-loop": Hugging Face Mixtral's MixtralSparseMoeBlock pattern - a one-hot expert mask,
    then per expert torch.where for its rows, index_select, the expert MLP, index_add_.
  - "sorted": the megablocks-style layout - (token, slot) pairs sorted by expert once, rows
    gathered into one expert-major buffer, each expert's contiguous slice through its MLP,
    scattered back with the gate weights by one index_add_.
Each is timed best of --reps after a warm-up; the faster is PyTorch's number. Then
build/bench/bench_moe_layer runs with the same shape and thread count, and the script prints
tokens/s for all three and ours / best PyTorch. Needs torch; not run by the test suite.
"""

import argparse
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def make_weights(d, e, f, gen):
    s = 0.02
    return {
        "router": (torch.randn(e, d, generator=gen) * s).requires_grad_(),
        "w1": (torch.randn(e, f, d, generator=gen) * s).requires_grad_(),
        "w3": (torch.randn(e, f, d, generator=gen) * s).requires_grad_(),
        "w2": (torch.randn(e, d, f, generator=gen) * s).requires_grad_(),
    }


def route(x, w, k):
    logits = x @ w["router"].t()
    probs = torch.softmax(logits, dim=-1)
    gates, experts = torch.topk(probs, k, dim=-1)
    return gates, experts


def hf_loop(x, w, k):
    t, d = x.shape
    e = w["router"].shape[0]
    gates, experts = route(x, w, k)
    out = torch.zeros_like(x)
    mask = F.one_hot(experts, num_classes=e).permute(2, 1, 0)  # [E, k, T]
    for i in range(e):
        slot, tok = torch.where(mask[i])
        if tok.numel() == 0:
            continue
        xi = x.index_select(0, tok)
        h = F.silu(xi @ w["w1"][i].t()) * (xi @ w["w3"][i].t())
        yi = (h @ w["w2"][i].t()) * gates[tok, slot].unsqueeze(1)
        out = out.index_add(0, tok, yi)
    return out


def sorted_experts(x, w, k):
    t, d = x.shape
    e = w["router"].shape[0]
    gates, experts = route(x, w, k)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.bincount(flat, minlength=e).tolist()
    rows = x.index_select(0, tok)  # expert-major
    outs = []
    start = 0
    for i, n in enumerate(counts):
        if n == 0:
            continue
        xi = rows[start : start + n]
        h = F.silu(xi @ w["w1"][i].t()) * (xi @ w["w3"][i].t())
        outs.append(h @ w["w2"][i].t())
        start += n
    y = torch.cat(outs, 0) * gates.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, y)


def best_seconds(fn, reps):
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    a = ap.parse_args()
    threads = a.threads or os.cpu_count()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    w = make_weights(a.d, a.experts, a.ffn, gen)
    x = torch.randn(a.tokens, a.d, generator=gen).requires_grad_()
    dy = torch.randn(a.tokens, a.d, generator=gen)
    # The two implementations compute the same function (checked before timing).
    y1, y2 = hf_loop(x, w, a.k), sorted_experts(x, w, a.k)
    err = (y1 - y2).abs().max().item() / max(y1.abs().max().item(), 1e-30)
    if err > 1e-5:
        sys.exit(f"hf-loop and sorted disagree: relative {err:.3g}")

    def fwd_bwd(impl):
        def run():
            for p in list(w.values()) + [x]:
                p.grad = None
            impl(x, w, a.k).backward(dy)

        return run

    print(f"torch {torch.__version__}, {threads} threads; T={a.tokens} d={a.d} E={a.experts} k={a.k} f={a.ffn}")
    results = {}
    for name, impl in (("hf-loop", hf_loop), ("sorted", sorted_experts)):
        s = best_seconds(fwd_bwd(impl), a.reps)
        results[name] = a.tokens / s
        print(f"  pytorch {name:8s} fwd+bwd {1000 * s:8.1f} ms, {results[name]:9.0f} tokens/s")
    best = max(results.values())
    ours_cmd = [os.path.join(a.build, "bench", "bench_moe_layer"), str(a.tokens), str(a.d), str(a.experts),
                str(a.k), str(a.ffn), "16", str(a.reps)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
    out = subprocess.run(ours_cmd, capture_output=True, text=True, env=env, check=True).stdout
    m = re.search(r"fused\s+forward.*?fwd\+bwd\s+([\d.]+) ms,\s+(\d+) tokens/s", out)
    if not m:
        sys.exit("could not read bench_moe_layer's output:\n" + out)
    ours = float(m.group(2))
    print(f"  ours (bench_moe_layer, fused) fwd+bwd {float(m.group(1)):8.1f} ms, {ours:9.0f} tokens/s")
    print(f"ours / best PyTorch: {ours / best:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()

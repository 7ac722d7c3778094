#!/usr/bin/env python3
"""An independent float64 NumPy implementation of train/MODEL.md: reads a checkpoint
(formats/ours/FORMAT.md; codec "none" shards, any box / flat-range layout) and computes the eval
number of MODEL.md section 9. It shares no code with the C++ trainer; agreement with
`reshard eval` (to ~1e-5 relative: float32 vs float64) checks both the code and the document.

  python3 train/reference.py CKPT [--data FILE] [--seq-len L] [--windows N]
  python3 train/reference.py STEP0_CKPT --check-init    # section 6, on a `--steps 0` checkpoint

Needs numpy and h5py.
"""
import argparse
import json
import math
import os

import h5py
import numpy as np

DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32}


def decode(raw, dtype):
    if dtype == "bf16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(raw, DTYPES[dtype]).astype(np.float64)


def load_checkpoint(path):
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    specs = {t["name"]: t for t in m["tensors"]}
    # Main-replica shards, grouped by (tensor, box): a box's flat buffer may arrive in ranges.
    boxes = {}
    files = {}
    for s in m["shards"]:
        if s["replica"]:
            continue
        if s["codec"] != "none":
            raise SystemExit("reference.py reads codec 'none' shards only")
        t = specs[s["tensor"]]
        f = files.setdefault(s["file"], h5py.File(os.path.join(path, s["file"]), "r"))
        data = decode(f[s["dataset"]][()].tobytes(), t["dtype"])
        off, shape = tuple(s["box"]["offset"]), tuple(s["box"]["shape"])
        buf = boxes.setdefault((s["tensor"], off, shape), np.zeros(int(np.prod(shape, dtype=np.int64))))
        r = s.get("range", {"begin": 0, "end": buf.size})
        buf[r["begin"]:r["end"]] = data
    tensors = {}
    for (name, off, shape), buf in boxes.items():
        full = tensors.setdefault(name, np.zeros(specs[name]["shape"]))
        full[tuple(slice(o, o + n) for o, n in zip(off, shape))] = buf.reshape(shape)
    return m["metadata"]["model"], tensors


M64 = (1 << 64) - 1


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for c in s.encode():
        h = ((h ^ c) * 0x100000001B3) & M64
    return h


def init_tensor(name, n, seed, init_std, n_layers):
    """MODEL.md section 6, element by element (slow but literal)."""
    if name.endswith("norm.weight"):
        return np.ones(n)
    if name.endswith("expert_bias"):
        return np.zeros(n)
    std = init_std / math.sqrt(2.0 * n_layers) if name.endswith(("attn.out.weight", "fc2.weight")) else init_std
    state = mix64(seed ^ fnv1a64(name))
    out = np.empty(n)
    for i in range(n):
        u = []
        for _ in range(2):
            state = (state + 0x9E3779B97F4A7C15) & M64
            u.append((mix64(state) >> 11) * 2.0**-53)
        out[i] = math.sqrt(-2.0 * math.log(1.0 - u[0])) * math.cos(2.0 * math.pi * u[1]) * std
    return np.float32(out).astype(np.float64)


def check_init(path):
    with open(os.path.join(path, "manifest.json")) as f:
        meta = json.load(f)["metadata"]
    c, p = load_checkpoint(path)
    worst = 0.0
    for name, value in p.items():
        if "/" in name or name == "optimizer.step":
            continue
        want = init_tensor(name, value.size, meta["train"]["seed"], meta["train"]["init_std"], c["n_layers"])
        worst = max(worst, float(np.max(np.abs(want - value.reshape(-1)))))
    print(json.dumps({"init_max_abs_diff": worst}))


def rmsnorm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def topk(score, k):
    # Descending score, ties to the lower index.
    return np.argsort(-score, kind="stable")[:k]


def rope(x, theta):  # x: [S, heads, dh]
    s, _, dh = x.shape
    half = dh // 2
    ang = np.arange(s)[:, None] * theta ** (-2.0 * np.arange(half) / dh)[None, :]
    c, sn = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * sn, b * c + a * sn], axis=-1)


def attention(u, wqkv, wout, c, qk_norm=None):
    s = u.shape[0]
    nq, nkv, dh = c["n_heads"], c["n_kv_heads"], c["head_dim"]
    qkv = u @ wqkv.T
    q = qkv[:, : nq * dh].reshape(s, nq, dh)
    k = qkv[:, nq * dh:(nq + nkv) * dh].reshape(s, nkv, dh)
    if qk_norm is not None:  # per-head RMSNorm of queries and keys before RoPE (MODEL.md section 4)
        q = rmsnorm(q, qk_norm[0], c["norm_eps"])
        k = rmsnorm(k, qk_norm[1], c["norm_eps"])
    q = rope(q, c["rope_theta"])
    k = rope(k, c["rope_theta"])
    v = qkv[:, (nq + nkv) * dh:].reshape(s, nkv, dh)
    ctx = np.zeros((s, nq, dh))
    mask = np.tril(np.ones((s, s), dtype=bool))
    for h in range(nq):
        g = h // (nq // nkv)
        sc = q[:, h] @ k[:, g].T / math.sqrt(dh)
        sc = np.where(mask, sc, -np.inf)
        ctx[:, h] = softmax(sc) @ v[:, g]
    return ctx.reshape(s, nq * dh) @ wout.T


def swiglu(x, fc1, fc2):
    f = fc1.shape[0] // 2
    a = x @ fc1.T
    return (silu(a[:, :f]) * a[:, f:]) @ fc2.T


def sinkhorn(logits, tol=1e-6, max_iters=1000):
    n, e = logits.shape
    c = np.exp(logits - logits.max())
    d0, d1 = np.ones(n), np.ones(e)
    for _ in range(max_iters):
        d0 = (1.0 / n) / (c @ d1)
        nxt = (1.0 / e) / (d0 @ c)
        change = np.max(np.abs(nxt / d1 - 1.0))
        d1 = nxt
        if change < tol:
            break
    return d0[:, None] * c * d1[None, :]


def route(l, c, bias):
    """Returns (experts [N, k], gates [N, k]) per MODEL.md section 5."""
    kind, k, e = c["router"], c["top_k"], c["n_experts"]
    pi = softmax(l)
    n = l.shape[0]
    sel = np.zeros((n, k), dtype=np.int64)
    gate = np.zeros((n, k))
    bal = sinkhorn(l) if kind == "sinkhorn" else None
    for t in range(n):
        if kind == "topk":
            sel[t] = topk(l[t], k)
            gate[t] = softmax(l[t, sel[t]])
        elif kind == "softmax_topk":
            sel[t] = topk(pi[t], k)
            gate[t] = pi[t, sel[t]]
        elif kind == "sigmoid_bias":
            s = 1.0 / (1.0 + np.exp(-l[t]))
            sel[t] = topk(s + bias, k)
            gate[t] = c["router_scale"] * s[sel[t]] / (s[sel[t]].sum() if k > 1 else 1.0)
        elif kind == "group_limited":
            g, kept = c["router_groups"], c["router_groups_kept"]
            per = e // g
            m = min(per, max(1, k // kept))
            gs = np.array([np.sort(pi[t, i * per:(i + 1) * per])[::-1][:m].sum() for i in range(g)])
            masked = np.full(e, -np.inf)
            for grp in topk(gs, kept):
                masked[grp * per:(grp + 1) * per] = pi[t, grp * per:(grp + 1) * per]
            sel[t] = topk(masked, k)
            gate[t] = pi[t, sel[t]]
        elif kind == "sinkhorn":
            sel[t] = topk(bal[t], k)
            gate[t] = 1.0 / (1.0 + np.exp(-l[t, sel[t]])) if k == 1 else pi[t, sel[t]]
        else:
            raise SystemExit("unknown router " + kind)
    return sel, gate


def moe(u, p, c, pre):
    l = u @ p[pre + "moe.router.weight"].T
    sel, gate = route(l, c, p.get(pre + "moe.router.expert_bias"))
    fc1, fc2 = p[pre + "moe.experts.fc1.weight"], p[pre + "moe.experts.fc2.weight"]
    out = np.zeros_like(u)
    for t in range(u.shape[0]):
        for j in range(c["top_k"]):
            ex = sel[t, j]
            out[t] += gate[t, j] * swiglu(u[t:t + 1], fc1[ex], fc2[ex])[0]
    if c.get("shared_ffn", 0) > 0:
        out += swiglu(u, p[pre + "moe.shared.fc1.weight"], p[pre + "moe.shared.fc2.weight"])
    return out


def window_ce(tokens, targets, p, c):
    eps = c["norm_eps"]
    h = p["embedding.weight"][tokens]
    for i in range(c["n_layers"]):
        pre = "layers.%d." % i
        u = rmsnorm(h, p[pre + "attn_norm.weight"], eps)
        qk = (p[pre + "attn.q_norm.weight"], p[pre + "attn.k_norm.weight"]) if c.get("qk_norm", False) else None
        h = h + attention(u, p[pre + "attn.qkv.weight"], p[pre + "attn.out.weight"], c, qk)
        u = rmsnorm(h, p[pre + "mlp_norm.weight"], eps)
        step = c.get("moe_layer_step", 1)
        moe_layer = (c["n_experts"] > 0 and i >= c["first_dense_layers"] and (i + 1) % step == 0
                     and i not in c.get("dense_layers", []))
        h = h + (moe(u, p, c, pre) if moe_layer else swiglu(u, p[pre + "mlp.fc1.weight"], p[pre + "mlp.fc2.weight"]))
    logits = rmsnorm(h, p["final_norm.weight"], eps) @ p["output.weight"].T
    mx = logits.max(axis=-1, keepdims=True)
    lse = (mx + np.log(np.exp(logits - mx).sum(axis=-1, keepdims=True)))[:, 0]
    return float(np.mean(lse - logits[np.arange(len(targets)), targets]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--windows", type=int, default=0)
    ap.add_argument("--check-init", action="store_true")
    a = ap.parse_args()
    if a.check_init:
        return check_init(a.checkpoint)
    c, p = load_checkpoint(a.checkpoint)
    data = np.frombuffer(open(a.data, "rb").read(), np.uint8).astype(np.int64)
    seq = a.seq_len or c["max_seq_len"]
    avail = (len(data) - 1) // seq
    n = min(a.windows, avail) if a.windows else avail
    ces = [window_ce(data[w * seq:(w + 1) * seq], data[w * seq + 1:(w + 1) * seq + 1], p, c) for w in range(n)]
    print(json.dumps({"mean_ce": sum(ces) / n, "windows": n, "seq_len": seq}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""An independent NumPy (float64) forward pass of a Hugging Face Mixtral directory, written
from transformers' modeling_mixtral (MixtralForCausalLM) rather than from our model: it reads
config.json and the safetensors files by their HF names (through the PyPI `safetensors`
package), and applies rotate-half RoPE, repeat_kv grouped-query attention, the router as
softmax over all experts -> top-k -> renormalise, and experts w2(silu(w1 x) * w3 x). It prints
the eval number of train/MODEL.md section 9 (mean cross-entropy over the first N windows of a
byte file), which must match `reshard eval` of the checkpoint the directory was exported from.

  python3 hf_mixtral_reference.py HF_DIR DATA_FILE --windows N [--seq-len S]

Needs numpy and safetensors.
"""
import argparse
import json
import os

import numpy as np
from safetensors.numpy import load_file


def load(hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    w = {}
    for name in files:
        for k, v in load_file(os.path.join(hf_dir, name)).items():  # f32 / f16 (numpy has no bf16)
            w[k] = v.astype(np.float64)
    return config, w


def rmsnorm(x, weight, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(tokens, c, w):
    S = len(tokens)
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    dh = c.get("head_dim") or c["hidden_size"] // nq
    eps, E, k = c["rms_norm_eps"], c["num_local_experts"], c["num_experts_per_tok"]
    inv_freq = 1.0 / (c["rope_theta"] ** (np.arange(0, dh, 2) / dh))
    freqs = np.outer(np.arange(S), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    h = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((S, S), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        u = rmsnorm(h, w[p + "input_layernorm.weight"], eps)
        q = (u @ w[p + "self_attn.q_proj.weight"].T).reshape(S, nq, dh).transpose(1, 0, 2)
        kk = (u @ w[p + "self_attn.k_proj.weight"].T).reshape(S, nkv, dh).transpose(1, 0, 2)
        v = (u @ w[p + "self_attn.v_proj.weight"].T).reshape(S, nkv, dh).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        kk = kk * cos + rotate_half(kk) * sin
        kk = np.repeat(kk, nq // nkv, axis=0)  # repeat_kv
        v = np.repeat(v, nq // nkv, axis=0)
        scores = q @ kk.transpose(0, 2, 1) * dh ** -0.5 + mask
        o = (softmax(scores) @ v).transpose(1, 0, 2).reshape(S, nq * dh)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        u = rmsnorm(h, w[p + "post_attention_layernorm.weight"], eps)
        logits = u @ w[p + "block_sparse_moe.gate.weight"].T
        probs = softmax(logits)
        out = np.zeros_like(u)
        for t in range(S):
            top = np.argsort(-probs[t], kind="stable")[:k]
            weights = probs[t, top] / np.sum(probs[t, top])
            for e, g in zip(top, weights):
                x = p + "block_sparse_moe.experts.%d." % e
                y = silu(u[t] @ w[x + "w1.weight"].T) * (u[t] @ w[x + "w3.weight"].T)
                out[t] += g * (y @ w[x + "w2.weight"].T)
        h = h + out
    h = rmsnorm(h, w["model.norm.weight"], eps)
    return h @ w["lm_head.weight"].T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("data")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=0)
    a = ap.parse_args()
    config, w = load(a.hf_dir)
    assert config["model_type"] == "mixtral" and not config.get("tie_word_embeddings", False)
    seq = a.seq_len or config["max_position_embeddings"]
    data = np.frombuffer(open(a.data, "rb").read(), np.uint8).astype(np.int64)
    ces = []
    for win in range(a.windows):
        x = data[win * seq:(win + 1) * seq]
        y = data[win * seq + 1:(win + 1) * seq + 1]
        logits = forward(x, config, w)
        m = np.max(logits, axis=-1, keepdims=True)
        lse = (m + np.log(np.sum(np.exp(logits - m), axis=-1, keepdims=True)))[:, 0]
        ces.append(float(np.mean(lse - logits[np.arange(len(y)), y])))
    print(json.dumps({"mean_ce": sum(ces) / len(ces), "windows": len(ces), "seq_len": seq}))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# FP8 import benchmark: writes a DeepSeek-V3-shaped Hugging Face directory whose `*_proj.weight`
# tensors are float8_e4m3fn with a float32 `_scale_inv` per 128x128 block (the released
# checkpoints' layout; values random, never NaN), then times `reshard import --format hf`
# (dequantizing to bf16 parameters, at ep=4,tp=2 under --memory-budget 256MiB) against
# `cp -r` + `sync` of the FP8 directory and of the checkpoint import writes, in the same run,
# with each command's peak RSS (GNU time); then `import --keep-fp8` and a `convert` of its
# output to ep=8 against `cp -r` of that checkpoint. The generator is Python's standard library only.
#
# Usage: bench/fp8_import.sh [BUILD_DIR (build)] [SCRATCH (/tmp)] [N_EXPERTS (64; a multiple of the 8 groups)]
# (N_EXPERTS 216 gives a 2.06 GiB FP8 directory and a 28 GiB checkpoint.)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SCRATCH=${2:-/tmp}
EXPERTS=${3:-64}
CLI=$BUILD/cli/reshard
DIR=$(mktemp -d "$SCRATCH/rs-bench-fp8-XXXXXX")
trap 'rm -rf "$DIR"' EXIT
python3 - "$DIR/hf" "$EXPERTS" <<'PY'
import json, math, os, struct, sys
out, E = sys.argv[1], int(sys.argv[2])
os.makedirs(out)
d, L, V, H, rq, rkv, dr, dn, dv, f, fd = 1024, 4, 32000, 16, 512, 256, 64, 128, 128, 1024, 4096
config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": V,
          "hidden_size": d, "intermediate_size": fd, "moe_intermediate_size": f, "num_hidden_layers": L,
          "num_attention_heads": H, "num_key_value_heads": H, "n_shared_experts": 1, "n_routed_experts": E,
          "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": rkv, "q_lora_rank": rq,
          "qk_rope_head_dim": dr, "qk_nope_head_dim": dn, "v_head_dim": dv, "n_group": 8, "topk_group": 4,
          "first_k_dense_replace": 1, "norm_topk_prob": True, "rope_interleave": True, "hidden_act": "silu",
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
          "num_nextn_predict_layers": 0,
          "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}}
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
tensors = []  # (name, dtype, shape)
def add(name, shape, fp8=False):
    if fp8:
        tensors.append((name, "F8_E4M3", shape))
        tensors.append((name + "_scale_inv", "F32", [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)]))
    else:
        tensors.append((name, "BF16", shape))
add("model.embed_tokens.weight", [V, d]); add("model.norm.weight", [d]); add("lm_head.weight", [V, d])
for i in range(L):
    p = f"model.layers.{i}."
    add(p + "input_layernorm.weight", [d]); add(p + "post_attention_layernorm.weight", [d])
    a = p + "self_attn."
    add(a + "q_a_proj.weight", [rq, d], True); add(a + "q_a_layernorm.weight", [rq])
    add(a + "q_b_proj.weight", [H * (dn + dr), rq], True)
    add(a + "kv_a_proj_with_mqa.weight", [rkv + dr, d], True); add(a + "kv_a_layernorm.weight", [rkv])
    add(a + "kv_b_proj.weight", [H * (dn + dv), rkv], True); add(a + "o_proj.weight", [d, H * dv], True)
    if i == 0:
        for n, s in (("gate", [fd, d]), ("up", [fd, d]), ("down", [d, fd])):
            add(p + f"mlp.{n}_proj.weight", s, True)
        continue
    add(p + "mlp.gate.weight", [E, d])
    tensors.append((p + "mlp.gate.e_score_correction_bias", "F32", [E]))
    for n, s in (("gate", [f, d]), ("up", [f, d]), ("down", [d, f])):
        add(p + f"mlp.shared_experts.{n}_proj.weight", s, True)
        for e in range(E):
            add(p + f"mlp.experts.{e}.{n}_proj.weight", s, True)
size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
header, off = {}, 0
for name, dt, shape in tensors:
    n = size[dt] * math.prod(shape)
    header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
    off += n
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
no_nan = bytes(range(256)).translate(bytes.maketrans(b"\x7f\xff", b"\x7e\xfe"))
one = struct.pack("<f", 2.0 ** -8)
with open(os.path.join(out, "model.safetensors"), "wb") as fh:
    fh.write(struct.pack("<Q", len(h)) + h)
    for name, dt, shape in tensors:
        n = size[dt] * math.prod(shape)
        if dt == "F32":
            fh.write(one * (n // 4))  # scales (and the bias): 2^-8
        elif dt == "BF16":
            fh.write(b"\x80\x3f" * (n // 2))  # 1.0
        else:
            left = n
            while left > 0:
                chunk = min(left, 1 << 24)
                fh.write(os.urandom(chunk).translate(no_nan))
                left -= chunk
PY
size() { du -sb "$1" | cut -f1; }
gib() { awk -v b="$1" 'BEGIN { printf "%.2f GiB", b / 1073741824 }'; }
timed() {
  /usr/bin/time -f "%e %M" -o "$DIR/time" "$@" >/dev/null 2>"$DIR/err" || { cat "$DIR/err" >&2; exit 1; }
  cat "$DIR/time"
}
cp_sync() { cp -r "$1" "$2" && sync; }
export -f cp_sync
sync
echo "FP8 directory: $(gib "$(size "$DIR/hf")") (DeepSeek-V3-shaped, 4 layers, d_model 1024, $EXPERTS experts of 1024, vocab 32000)"
read -r t_cp1 _ < <(timed bash -c "cp_sync '$DIR/hf' '$DIR/hf-copy'")
rm -rf "$DIR/hf-copy"
read -r t_imp rss_imp < <(timed "$CLI" import "$DIR/hf" --format hf --layout ep=4,tp=2 --param-dtype bf16 \
  --memory-budget 256MiB -o "$DIR/imp")
sync
read -r t_cp2 _ < <(timed bash -c "cp_sync '$DIR/imp' '$DIR/imp-copy'")
printf '\n%-58s %8s %10s %10s %10s\n' operation seconds written "vs cp -r" "peak RSS"
printf '%-58s %8.2f %10s %10s %10s\n' "cp -r + sync of the FP8 directory" "$t_cp1" "$(gib "$(size "$DIR/hf")")" - -
printf '%-58s %8.2f %10s %10s %10s\n' "cp -r + sync of the imported checkpoint" "$t_cp2" "$(gib "$(size "$DIR/imp")")" 1.00x -
printf '%-58s %8.2f %10s %9.2fx %7d MiB\n' "import --format hf, FP8 -> bf16 (--memory-budget 256MiB)" "$t_imp" \
  "$(gib "$(size "$DIR/imp")")" "$(awk -v a="$t_cp2" -v b="$t_imp" 'BEGIN { print a / b }')" $((rss_imp / 1024))
rm -rf "$DIR/imp" "$DIR/imp-copy"
# FP8 kept (import --keep-fp8): the weights stay FP8 with their scales, no optimizer state; then a
# convert to another layout, which moves weights and scales together, against cp -r of its input.
read -r t_keep rss_keep < <(timed "$CLI" import "$DIR/hf" --format hf --layout ep=4,tp=2 --keep-fp8 \
  --memory-budget 256MiB -o "$DIR/keep")
sync
read -r t_cp3 _ < <(timed bash -c "cp_sync '$DIR/keep' '$DIR/keep-copy'")
rm -rf "$DIR/keep-copy"
read -r t_conv rss_conv < <(timed "$CLI" convert "$DIR/keep" --to ep=8 --memory-budget 256MiB -o "$DIR/keep-ep8")
printf '%-58s %8.2f %10s %10s %10s\n' "cp -r + sync of the FP8-kept checkpoint" "$t_cp3" "$(gib "$(size "$DIR/keep")")" 1.00x -
printf '%-58s %8.2f %10s %9.2fx %7d MiB\n' "import --keep-fp8 (ep=4,tp=2, --memory-budget 256MiB)" "$t_keep" \
  "$(gib "$(size "$DIR/keep")")" "$(awk -v a="$t_cp3" -v b="$t_keep" 'BEGIN { print a / b }')" $((rss_keep / 1024))
printf '%-58s %8.2f %10s %9.2fx %7d MiB\n' "convert FP8-kept ep=4,tp=2 -> ep=8 (--memory-budget 256MiB)" "$t_conv" \
  "$(gib "$(size "$DIR/keep-ep8")")" "$(awk -v a="$t_cp3" -v b="$t_conv" 'BEGIN { print a / b }')" $((rss_conv / 1024))

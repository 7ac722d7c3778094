#!/usr/bin/env bash
# Measures the fault matrix: each fault a cluster hits, injected into each command it concerns,
# and what the command does - its exit code, whether its error names the file, whether it left
# anything that looks like output (a staging directory, a manifest, the target), and whether its
# source is byte for byte unchanged. Prints one Markdown table. The tests in
# tests/cli/faults_test.cc assert the same behaviour; this script is for reading the whole matrix
# at once (and for the numbers in a closing note).
#
# Usage: scripts/fault_matrix.sh [BUILD_DIR]     (default build/; needs reshard and the EIO
#        preload library of the test build, build/tests/librs_eio_preload.so)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
R=$(realpath "$BUILD/cli/reshard")
EIO=$(realpath "$BUILD/tests/librs_eio_preload.so" 2>/dev/null || true)
[ -x "$R" ] || { echo "fault_matrix: no $BUILD/cli/reshard (build first)" >&2; exit 2; }
T=$(mktemp -d /tmp/rs-faults-XXXXXX)
trap 'rm -rf "$T"' EXIT

# Sources: a small checkpoint, a medium one (seconds to convert, so a signal lands mid-write),
# its Hugging Face export, and a text file for eval.
cat > "$T/medium.json" <<'EOF'
{"name": "medium", "vocab_size": 8192, "d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
 "head_dim": 64, "dense_ffn": 512, "n_experts": 8, "top_k": 2, "moe_ffn": 512, "max_seq_len": 64}
EOF
"$R" example --model tiny-moe --layout tp=2 -o "$T/src" >/dev/null
"$R" example --model "$T/medium.json" --layout tp=2 -o "$T/msrc" >/dev/null
"$R" export "$T/src" --format hf -o "$T/hf" >/dev/null
"$R" export "$T/msrc" --format hf -o "$T/mhf" >/dev/null
head -c 20000 /usr/share/common-licenses/GPL-3 > "$T/text.txt"
snapshot() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum) ; }
for s in src msrc hf mhf; do snapshot "$T/$s" > "$T/$s.sha"; done

# The command of each column for a given output path ($1); the source it reads.
cmd_of() {
  case "$2" in
    convert) echo "convert $T/$3 --to tp=1 --threads 1 --codec zstd --memory-budget 8MiB -o $1" ;;
    example) echo "example --model $T/medium.json --layout tp=2 --threads 1 --codec zstd -o $1" ;;
    export) echo "export $T/$3 --format hf --memory-budget 8MiB -o $1" ;;
    import) echo "import $T/${3/src/hf} --format hf --layout tp=2 --codec zstd --memory-budget 8MiB -o $1" ;;
    train) echo "train --model tiny-moe --steps 3 --threads 1 --save-every 1 --save $1" ;;
    train-async) echo "train --model tiny-moe --steps 3 --threads 1 --save-every 1 --save $1 --async-save" ;;
    verify) echo "verify $T/$3" ;;
    diff) echo "diff $T/$3 $T/$3" ;;
    eval) echo "eval $T/$3 --data $T/text.txt --windows 4" ;;
  esac
}
source_of() { case "$1" in import) echo "${2/src/hf}" ;; example | train*) echo "" ;; *) echo "$2" ;; esac; }
COMMANDS=(convert example export import train train-async verify diff eval)

# What a run left: "nothing" or what looks like output.
leftovers() {
  local out=$1 found
  found=$( (ls -d "$out".tmp-* "$out"-removing 2>/dev/null; [ -e "$out/manifest.json" ] && echo manifest;
            [ -d "$out" ] && find "$out" -name 'step-*' -maxdepth 1 -type d ! -name '*.tmp-*' |
              while read -r s; do [ -e "$s/manifest.json" ] || echo "partial $s"; done) | wc -l)
  [ "$found" -eq 0 ] && echo "nothing left" || echo "$found leftover(s)"
}
unchanged() {
  [ -z "$1" ] && { echo ""; return; }
  snapshot "$T/$1" | cmp -s - "$T/$1.sha" && echo ", source unchanged" || echo ", SOURCE CHANGED"
}
cell() {  # rc, log, out, source, file-to-name
  local rc=$1 log=$2 out=$3 src=$4 name=$5
  local text named=""
  [ -n "$name" ] && grep -q -- "$name" "$log" && named=", names the file"
  text="exit $rc$named"
  [ -n "$out" ] && text="$text, $(leftovers "$out")"
  echo "$text$(unchanged "$src")"
}

declare -A M
run_fault() {  # fault-name command -> fills M
  local fault=$1 c=$2
  local out="$T/out-$fault-$c" log="$T/log-$fault-$c" src cmd rc pid
  rm -rf "$out"*
  src=$(source_of "$c" src)
  case "$fault" in
    disk)
      case "$c" in verify | diff | eval) M[$fault,$c]="–"; return ;; esac
      src=$(source_of "$c" src)
      cmd=$(cmd_of "$out" "$c" src)
      bash -c "trap '' XFSZ; ulimit -f 512; exec $R $cmd" >"$log" 2>&1; rc=$?
      M[$fault,$c]=$(cell $rc "$log" "$(case $c in train*) ;; *) echo "$out" ;; esac)" "$src" "$T/out-")
      ;;
    sigterm)
      case "$c" in verify | diff | eval) M[$fault,$c]="–"; return ;; esac
      src=$(source_of "$c" msrc)
      cmd=$(cmd_of "$out" "$c" msrc)
      if [[ $c == train* ]]; then
        # a save is being written: kill when the second step's staging appears
        bash -c "set -m; $R $cmd & pid=\$!; for i in \$(seq 1 3000); do ls -d $out/step-00000002.tmp-* >/dev/null 2>&1 && break; sleep 0.005; done; kill -TERM \$pid; wait \$pid" >"$log" 2>&1; rc=$?
      else
        bash -c "set -m; $R $cmd & pid=\$!; for i in \$(seq 1 1000); do ls -d $out.tmp-* >/dev/null 2>&1 && break; sleep 0.01; done; kill -TERM \$pid; wait \$pid" >"$log" 2>&1; rc=$?
      fi
      M[$fault,$c]=$(cell $rc "$log" "$([[ $c == train* ]] && echo "" || echo "$out")" "$src" "")
      [[ $c == train* ]] && M[$fault,$c]="${M[$fault,$c]}, $(ls -d "$out"/step-* 2>/dev/null | grep -c -v '\.tmp-') committed step(s), $(leftovers "$out")"
      ;;
    eio)
      case "$c" in example | train*) M[$fault,$c]="–"; return ;; esac
      local file=/rank-00001.h5
      [ "$c" = import ] && file=.safetensors
      cmd=$(cmd_of "$out" "$c" src)
      env LD_PRELOAD="$EIO" RS_EIO_FILE=$file RS_EIO_FROM=4096 "$R" $cmd >"$log" 2>&1; rc=$?
      M[$fault,$c]=$(cell $rc "$log" "$(case $c in verify | diff | eval) ;; *) echo "$out" ;; esac)" "$src" "$file")
      ;;
    truncate)
      case "$c" in example | train*) M[$fault,$c]="–"; return ;; esac
      local copy="$T/trunc-$c" file=rank-00001.h5
      rm -rf "$copy"; cp -r "$T/$(source_of "$c" src)" "$copy"
      [ "$c" = import ] && file=$(cd "$copy" && ls -- *.safetensors | head -1)
      cmd=$(cmd_of "$out" "$c" "trunc-$c")
      [ "$c" = import ] && cmd="import $copy --format hf --layout tp=2 -o $out"
      [ "$c" = diff ] && cmd="diff $copy $T/src"
      # Truncated to half by the preload library on the command's 5th read of the file.
      env LD_PRELOAD="$EIO" RS_EIO_FILE="$copy/$file" RS_SHRINK_AT=5 "$R" $cmd >"$log" 2>&1; rc=$?
      M[$fault,$c]=$(cell $rc "$log" "$(case $c in verify | diff | eval) ;; *) echo "$out" ;; esac)" "" "$file")
      ;;
    second)
      case "$c" in convert | example | export | import | train*) ;; *) M[$fault,$c]="–"; return ;; esac
      cmd=$(cmd_of "$out" "$c" src)
      "$R" $cmd >"$log.1" 2>&1 & pid=$!
      "$R" $cmd >"$log" 2>&1; rc=$?
      wait $pid; local rc1=$?
      local sound="result verifies"
      if [[ $c == train* ]]; then
        for s in "$out"/step-*; do "$R" verify "$s" >/dev/null 2>&1 || sound="A STEP DOES NOT VERIFY"; done
      elif [ "$c" = export ]; then
        sound="result complete"
        [ -f "$out/model-00001-of-00001.safetensors" ] && [ -f "$out/config.json" ] || sound="NO RESULT"
      else
        "$R" verify "$out" >/dev/null 2>&1 || sound="RESULT DOES NOT VERIFY"
      fi
      M[$fault,$c]="exits $rc1 and $rc ($(grep -h -o -m1 -E 'appeared while writing|exists; not replaced|already exists|is being saved into by another' "$log" "$log.1" | head -1)), $sound"
      ;;
    nofile)
      case "$c" in example | train*) M[$fault,$c]="–"; return ;; esac
      cmd=$(cmd_of "$out" "$c" many)
      [ "$c" = import ] && { M[$fault,$c]="–"; return; }
      [ "$c" = export ] && cmd="export $T/many --format hf -o $out"
      bash -c "ulimit -n 32; exec $R $cmd" >"$log" 2>&1; rc=$?
      M[$fault,$c]="exit $rc$(grep -q 'SOUND' "$log" && echo " ($(grep -o -m1 -E '^(NOT )?SOUND' "$log"))")"
      ;;
  esac
}

"$R" example --model tiny-moe --layout fsdp=200,fsdp_form=flat -o "$T/many" >/dev/null

FAULTS=(disk sigterm eio truncate second nofile)
declare -A TITLE=(
  [disk]="disk full (\`ulimit -f 512\`, EFBIG)"
  [sigterm]="SIGTERM while writing"
  [eio]="EIO reading a source file (past 4 KiB)"
  [truncate]="source file truncated to half at its 5th read"
  [second]="two writers, one target"
  [nofile]="\`ulimit -n 32\`, 200-file source"
)
for f in "${FAULTS[@]}"; do for c in "${COMMANDS[@]}"; do run_fault "$f" "$c"; done; done

printf '| fault |'; for c in "${COMMANDS[@]}"; do printf ' %s |' "$c"; done; echo
printf '|---|'; for c in "${COMMANDS[@]}"; do printf -- '---|'; done; echo
for f in "${FAULTS[@]}"; do
  printf '| %s |' "${TITLE[$f]}"
  for c in "${COMMANDS[@]}"; do printf ' %s |' "${M[$f,$c]}"; done
  echo
done

#!/usr/bin/env bash
# The Gemma 3 270M measurements of benchmarks/results/gemma3_270m/README.md, in priority order.
# Run from the repository root with the .venv of `make test` (2 CPU cores: about an hour).
set -euo pipefail
M=.venv/bin/million-jax
R=benchmarks/results/gemma3_270m
B=${BOOKS:-/tmp/g3books}
mkdir -p "$B"
log() { echo "[$(date +%H:%M:%S)] $*"; }
cal() {  # name bits rope seed
  [ -f "$B/$1.st" ] || { log "calibrate $1"; /usr/bin/time -f "%e s wall %U s user" -o "$R/calib_$1.time" \
    $M calibrate --model gemma3-270m --text builtin:calib --tokens 8192 --bits "$2" --rope "$3" --seed "$4" \
    --out "$B/$1.st" --force; }
}
ev() {  # name protocol [cache args...]
  local n=$1 proto=$2; shift 2
  [ -f "$R/eval_${n}_${proto}.json" ] || { log "eval $n $proto"; $M eval --model gemma3-270m --text builtin:eval \
    --window 512 --max-tokens 4096 "$@" --json "$R/eval_${n}_${proto}.json" --force --quiet; }
}
ev dense all
cal pq4-pre-s0 4 pre 0
ev pq4-pre-s0 all --protocol all --cache pq --codebooks "$B/pq4-pre-s0.st"
ev pq4-pre-s0 realistic --protocol realistic --cache pq --codebooks "$B/pq4-pre-s0.st"
cal pq2-pre-s0 2 pre 0
ev pq2-pre-s0 all --protocol all --cache pq --codebooks "$B/pq2-pre-s0.st"
ev pq2-pre-s0 realistic --protocol realistic --cache pq --codebooks "$B/pq2-pre-s0.st"
cal pq4-post-s0 4 post 0
ev pq4-post-s0 all --protocol all --cache pq --codebooks "$B/pq4-post-s0.st"
ev pq4-post-s0 realistic --protocol realistic --cache pq --codebooks "$B/pq4-post-s0.st"
cal pq3-pre-s0 3 pre 0
ev pq3-pre-s0 all --protocol all --cache pq --codebooks "$B/pq3-pre-s0.st"
log "step time + bytes"
PYTHONPATH=. .venv/bin/python benchmarks/gemma3_step_time.py --codebooks "$B/pq4-pre-s0.st" --json "$R/step_time.json"
pk() {  # name lengths [cache args...]
  local n=$1 L=$2; shift 2
  [ -f "$R/passkey_${n}_${L//,/_}.json" ] || { log "passkey $n $L"; $M passkey --model gemma3-270m --lengths "$L" \
    --trials 3 --batch 3 "$@" --json "$R/passkey_${n}_${L//,/_}.json" --force --quiet; }
}
pk dense 4096,8192
pk pq4-all 4096,8192 --cache pq --codebooks "$B/pq4-pre-s0.st" --protocol all
pk pq2-realistic 4096,8192 --cache pq --codebooks "$B/pq2-pre-s0.st" --protocol realistic
pk pq2-all 4096,8192 --cache pq --codebooks "$B/pq2-pre-s0.st" --protocol all
cal pq4-pre-s1 4 pre 1
ev pq4-pre-s1 all --protocol all --cache pq --codebooks "$B/pq4-pre-s1.st"
cal pq2-pre-s1 2 pre 1
ev pq2-pre-s1 all --protocol all --cache pq --codebooks "$B/pq2-pre-s1.st"
pk dense 16384
pk pq4-all 16384 --cache pq --codebooks "$B/pq4-pre-s0.st" --protocol all
pk dense 32768
pk pq4-all 32768 --cache pq --codebooks "$B/pq4-pre-s0.st" --protocol all
log done

#!/usr/bin/env bash
# A step change's A/B on one GPU (700fd53: RoPE with the K/V store in one launch, the residual in
# place, FlashInfer writing the prefill rows itself), run from the repository root:
#   git archive BASE chunkserve configs pyproject.toml | xz > build/base.tar.xz   # here, then carry build
#   OUT=DIR bash chunkserve/replicas/tools/records/step_ab_gpu.sh build/base.tar.xz
# First the kernels' and the piecewise graphs' tests on CUDA (bit-exactness of the change), then
# profile_decode at BASE (a copy of its tree in /tmp/step-ab-base) and at this tree, each in its
# own process: the mixed step (8 decode rows, each step prefilling a 1024-token arrival) and the
# decode step after a 2048-token shared prefix (1 / 16 / 64 rows). JSON lines to
# $OUT/{mixed,gsp}-{base,new}.jsonl, a summary on stdout. TEST_S, PD_S: per-command time limits.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-.}
base=/tmp/step-ab-base
[ -d $base ] || { mkdir -p $base && tar xJf "${1:?a tar.xz of the base tree}" -C $base; }
here=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${TEST_S:-300}" python -m pytest -q -p no:cacheprovider -m "not gpu2 and not gpu4" tests/test_norm_rope.py 2>&1 | tail -2
timeout "${TEST_S:-300}" python -m pytest -q -p no:cacheprovider -m gpu tests/test_piecewise.py 2>&1 | tail -2
ab() {  # name, profile_decode's arguments
  local name=$1; shift
  for t in base new; do
    d=$here; [ $t = base ] && d=$base
    (cd $d && timeout "${PD_S:-300}" python -m chunkserve.replicas.tools.profile_decode --model llama3-8b "$@" \
      > "$OUT/$name-$t.jsonl" 2> "$OUT/$name-$t.err")
    echo "$name $t rc=$?"
    python -c 'import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "batch" in d: print(d["batch"], d["wall_ms_per_step"], d["kernels_per_step"], d["kind_ms_per_step"])' "$OUT/$name-$t.jsonl"
  done
}
ab mixed --prefix 0 --suffix 1024 --arrival 1024 --batch 8 --steps 20
ab gsp --prefix 2048 --suffix 64 --batch 1,16,64 --steps 20

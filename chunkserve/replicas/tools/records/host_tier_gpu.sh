#!/usr/bin/env bash
# Issue #48's GPU runs (records h100-2026-12-06 / -07): the host tier in one engine, then through
# the stack with the router's tier credit. Run from the repository root on the GPU machine:
#   OUT=DIR bash chunkserve/replicas/tools/records/host_tier_gpu.sh engine
#   OUT=DIR bash chunkserve/replicas/tools/records/host_tier_gpu.sh ahead
#   OUT=DIR RATES=4 bash chunkserve/replicas/tools/records/host_tier_gpu.sh stack CREDIT [path=value ...]
# engine: bench_host_tier cached (32 prefixes of 8192 tokens, 4x a 65536-token pool), ttft (2048
# and 8192), bandwidth, each line appended to $OUT/host_tier.jsonl. ahead: the same cached
# workload with the tier, copies written ahead of eviction (the default) and not
# (host_write_ahead_tokens 0), then ttft, to $OUT/host_tier.jsonl. stack: router_gpu.sh's fleet
# (chunkserve/cluster/loadtest/records) serving 48 tenants whose prompts total 4x the fleet's GPU
# pools (an H100: 3 replicas of 16384 tokens, prompts of 4096), each replica with a host tier of 4x
# its pool, 320 requests, --tenant-zipf 0.6, and router.host_hit_credit CREDIT (0: a host hit
# counts as a miss), labelled creditCREDIT. The run of h100-2026-12-07b (16 tenants x 3584, 1.2x
# the pools) is `TENANTS=16 TLEN=3584 PROMPTS=160 ZIPF= HOST=65536 ... stack CREDIT`.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-.}
mode=${1:?engine, ahead or stack}; shift
if [ "$mode" = engine ]; then
  B="python -m chunkserve.replicas.tools.bench_host_tier"
  timeout 450 $B cached --model llama3-8b --kv-cache-tokens 65536 --tenants 32 --requests 512 | tee -a "$OUT/host_tier.jsonl"
  timeout 120 $B ttft --model llama3-8b --prefix 2048,8192 --repeat 3 | tee -a "$OUT/host_tier.jsonl"
  timeout 150 $B bandwidth --model llama3-8b --prefix 8192 | tee -a "$OUT/host_tier.jsonl"
elif [ "$mode" = ahead ]; then
  B="python -m chunkserve.replicas.tools.bench_host_tier"
  timeout 330 $B cached --model llama3-8b --kv-cache-tokens 65536 --tenants 32 --requests 512 \
    --runs gpu+host,gpu+host_no_ahead | tee -a "$OUT/host_tier.jsonl"
  timeout 120 $B ttft --model llama3-8b --prefix 2048,8192 --repeat 3 | tee -a "$OUT/host_tier.jsonl"
else
  CREDIT=${1:?CREDIT: router.host_hit_credit}; shift
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$mem" -gt 100000 ]; then N=4 KV=32768; else N=3 KV=16384; fi  # router_gpu.sh's fleet
  export TENANTS=${TENANTS:-48} PROMPTS=${PROMPTS:-320} ZIPF=${ZIPF-0.6}
  export TLEN=${TLEN:-$((4 * N * KV / TENANTS / 64 * 64))}
  LABEL=credit$CREDIT OUT=$OUT bash chunkserve/cluster/loadtest/records/router_gpu.sh prefix \
    engine.host_cache_tokens="${HOST:-$((4 * KV))}" router.host_hit_credit="$CREDIT" "$@"
fi

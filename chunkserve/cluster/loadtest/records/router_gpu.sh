#!/usr/bin/env bash
# Issue #47's router runs on one GPU (records h100-2026-12-06*-routers): a fresh application per
# call, N llama3-8b replicas sharing the GPU, `tenants` TENANTS (16) x TLEN, PROMPTS (160)
# requests, seed 21 (ZIPF: the tenants' --tenant-zipf, the workload's own by default).
#   RATES=4,8 bash chunkserve/cluster/loadtest/records/router_gpu.sh POLICY [path=value ...]
# POLICY prefix | pow2 | ray_prefix; extra path=value pairs become --set. An H100 (80 GB) gets
# 3 replicas of 16384 KV tokens and 3584-token prompts, a larger card 4 x 32768 and 7168.
# Reports go to $OUT (default .) as LABEL.jsonl, Serve's log beside them. ray_prefix needs
# Ray's own ray.llm package, which the GPU bundle drops: RAY_LLM_TGZ names a tarball of the
# ray-2.60.0 wheel's ray/llm folder, unpacked into the bundle's site (/tmp/gpu-site/ray).
set -u
POLICY=$1; shift
OUT=${OUT:-.}
LABEL=${LABEL:-$POLICY}
RATES=${RATES:-4,8}; PROMPTS=${PROMPTS:-160}; LIMIT=${LIMIT:-560}; TENANTS=${TENANTS:-16}; ZIPF=${ZIPF:-}
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 100000 ]; then N=4 KV=32768 L=7168; else N=3 KV=16384 L=3584; fi
TLEN=${TLEN:-$L}
DS=false; [ "$POLICY" = prefix ] && DS=true  # direct streams are the prefix router's
if [ "$POLICY" = ray_prefix ] && ! python -c "import ray.llm" 2>/dev/null; then
  tar xzf "${RAY_LLM_TGZ:?ray_prefix needs ray.llm: set RAY_LLM_TGZ}" -C /tmp/gpu-site/ray
fi
extra=(); for a in "$@"; do extra+=(--set "$a"); done
zipf=(); [ -n "$ZIPF" ] && zipf=(--tenant-zipf "$ZIPF")
export PYTHONUNBUFFERED=1
timeout "$LIMIT" python -m chunkserve.cluster.loadtest.stack configs/llama3-8b.yaml --ready-timeout 400 \
  --log "$OUT/serve-$LABEL.log" \
  --set num_replicas=$N --set num_gpus_per_replica=0.25 --set engine.kv_cache_tokens=$KV \
  --set engine.max_num_batched_tokens=4096 --set engine.max_num_seqs=128 \
  --set router.policy="$POLICY" --set router.direct_stream=$DS "${extra[@]}" -- \
  --prompt-format tokens --workload tenants --tenants "$TENANTS" --tenant-prompt-len "$TLEN" "${zipf[@]}" \
  --num-prompts "$PROMPTS" --seed 21 --sweep "$RATES" --label "$LABEL" --save-result "$OUT/$LABEL.jsonl"
echo "rc=$?"
python -m ray.scripts.scripts stop --force >/dev/null 2>&1

#!/usr/bin/env bash
# One GPU session's checks, in one call of the device tool (see README "Kernels").
# Usage on the GPU machine, from the repository root:  bash scripts/gpu/check.sh STAGE...
# Stages: env, install, gpu-tests, ep-cuda, correctness (gpu-tests and ep-cuda side by side), train, modern,
#   suite, kernels, kernels-fine, layer, layer-ab, hf, hf-ab, hf-bench, calibrate, count-exchange,
#   relay-fetch, ep-ahead, planner, plan-overlap, ahead-pipeline.
# install: the project from this tree (PYTHONPATH) and, when .whl/ holds them, the pinned wheels the
#   image lacks (transformers), unpacked into /tmp/site (no registry is reachable there).
# ep-cuda: a2a/shadow/mix on CUDA tensors, 2 and 3 gloo ranks on the one GPU, vs the single-rank layer.
# ep-ahead: the same with mix under MoEConfig.plan_ahead (a first step, then the checked one fits
#   its plan: the compiled fit and the background plan on the GPU machine's host).
# planner: bench planner on the GPU machine's host CPU (where the layer plans), one link and nodes:
#   the plan, its bookkeeping, "exposed ms" (planning the step's counts) and "ahead exposed ms" (plan_ahead).
# plan-overlap: a one-GPU layer step alone and while threads plan W = 256 / 1024 back to back (does
#   plan_ahead's background planning delay the main thread's launches? 1 and 4 threads).
# ahead-pipeline: plan_ahead's planning threads for 1-8 MoE layers at W = 1024 under nodes on this
#   host's CPU (scripts/ahead_pipeline.py, the device time simulated): the step's wait for them.
# train: the first GPU training run (gpt2 base, bf16 autocast, ~100 steps).
# modern: the DeepSeek-style layer on CUDA (fp32 router under bf16) and `train --model deepseek`.
# kernels-fine: the fine-grained shape (256 experts, top-8, D2048 F1024, SwiGLU).
# count-exchange: the count exchange's host side and the plan from the device's sums, W = 64..1024 (issue 26).
# relay-fetch: the replica fetch at one rank under nodes (build, forward, backward; .gpu_old/mixmoe_s5 = af7e0cd).
# calibrate: one-GPU calibration, then the simulator's local-step predictions against bench layer (issue 9).
# hf-bench: a transformers Mixtral's train step under each experts implementation (issue 14's one-device target).
# layer-ab / hf-ab: the grouped-GEMM path (MIXMOE_GROUPED_MM=1, default) then the Triton kernels (=0). Logs go to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc ($(date +%T))"; tail -n "${TAIL:-25}" "$OUT/$name.log"
}
for stage in "$@"; do case $stage in
  env) nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
       $PY -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')";;
  install) if ls .whl/*.whl > /dev/null 2>&1; then
         $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
           > "$OUT/install.log" 2>&1; echo "wheels rc=$?"; export PYTHONPATH=/tmp/site:$PWD
       else export PYTHONPATH=$PWD; fi
       $PY -c "import mixmoe, transformers; print('mixmoe from', mixmoe.__file__, 'transformers', transformers.__version__)"
       # the planner's compiled fill, built here once (the ep-cuda ranks then load it)
       $PY -c "from mixmoe.placement import native_lib as n; print('compiled planner parts:', n.available(), n.unavailable_reason() or '')";;
  gpu-tests) run gpu-tests "${GPU_TESTS_S:-300}" $PY -m pytest tests/kernels tests/tracing tests/dispatch/test_count_matrix_to_host.py tests/dispatch/test_replicas.py -m gpu -o addopts= -q -ra -p no:cacheprovider -n ${GPU_N:-4};;
  count-exchange) run count-exchange "${CX_S:-120}" $PY scripts/gpu/count_exchange.py --device cuda;;
  relay-fetch) run relay-fetch "${RF_S:-180}" $PY scripts/gpu/relay_fetch.py --device cuda \
       $( [ -d .gpu_old/mixmoe_s5 ] && echo --old .gpu_old );;
  ep-cuda) run ep-cuda "${EP_S:-240}" $PY scripts/gpu/ep_one_gpu.py --world ${EP_WORLD:-2,3} --device cuda;;
  planner) for p in gpu h100-nvlink-ib; do run planner-$p "${PLANNER_S:-150}" $PY -m mixmoe bench planner \
         --cases 8x64,64x256,256x1024,1024x4096 --routing zipf:1.2 --repeats 21 --old-max-world 0 \
         --profile $p --markdown --jsonl "$OUT/planner.jsonl"; done;;
  plan-overlap) for n in 1 4; do run plan-overlap-$n "${PO_S:-120}" $PY scripts/gpu/plan_overlap.py \
         --device cuda --layers $n; done;;
  ahead-pipeline) for d in sleep busy; do run ahead-pipeline-$d "${AP_S:-90}" $PY scripts/ahead_pipeline.py \
         --layers 1,2,4,8 --iterations 22 --device $d; done;;
  ep-ahead) run ep-ahead "${EP_S:-240}" $PY scripts/gpu/ep_one_gpu.py --world ${EP_WORLD:-2,3} --device cuda --plan-ahead;;
  correctness) GPU_N=${GPU_N:-4}
       ( run gpu-tests "${GPU_TESTS_S:-240}" $PY -m pytest tests/kernels tests/tracing tests/dispatch/test_count_matrix_to_host.py tests/dispatch/test_replicas.py -m gpu -o addopts= -q -ra -p no:cacheprovider -n $GPU_N ) > "$OUT/correctness-a.txt" 2>&1 &
       ( run ep-cuda "${EP_S:-240}" $PY scripts/gpu/ep_one_gpu.py --world ${EP_WORLD:-2,3} --device cuda ) > "$OUT/correctness-b.txt" 2>&1 &
       wait; cat "$OUT/correctness-a.txt" "$OUT/correctness-b.txt";;
  modern) run ds-cuda "${DS_S:-60}" $PY scripts/gpu/ds_cuda.py
       run train-deepseek "${TRAIN_S:-150}" $PY -m mixmoe train --model deepseek --preset base --device cuda \
         --dtype bfloat16 --max-steps ${TRAIN_STEPS:-100} --eval-every 50 --out "$OUT/train-deepseek" --no-progress;;
  train) run train "${TRAIN_S:-150}" $PY -m mixmoe train --model ${TRAIN_MODEL:-gpt2} --preset base --device cuda \
         --dtype bfloat16 --max-steps ${TRAIN_STEPS:-100} --eval-every 50 --out "$OUT/train" --no-progress;;
  kernels-fine) run kernels-fine "${KERNELS_S:-150}" $PY -m mixmoe bench kernels --device cuda --dtype bf16 \
       --model-dim 2048 --hidden-size 1024 --rows-per-expert ${FINE_ROWS:-256} --experts 256 --top-k 8 \
       --skew uniform --activation swiglu --mode fwd+bwd --warmup 3 --repeats 10 --jsonl "$OUT/kernels-fine.jsonl";;
  suite) run suite "${SUITE_S:-420}" $PY -m pytest tests -m "not gpu" -o addopts= -q -ra -p no:cacheprovider -n ${SUITE_N:-12};;

  kernels) run kernels "${KERNELS_S:-300}" $PY -m mixmoe bench kernels --device cuda --dtype bf16 \
       --model-dim 1024 --hidden-size 4096 --rows-per-expert ${ROWS:-256,1024,4096} \
       --experts ${EXPERTS:-4,16,64} --skew ${SKEW:-uniform} --activation ${ACT:-gelu} \
       --mode ${KMODE:-fwd,fwd+bwd} --warmup 5 --repeats 20 --jsonl "$OUT/kernels.jsonl";;
  layer) for e in ${LAYER_EXPERTS:-4 16 64}; do
       run layer-e$e "${LAYER_S:-120}" $PY -m mixmoe bench layer --device cuda --dtype bf16 \
         --model-dim 1024 --hidden-size 4096 --tokens 8192 --num-local-experts $e --top-k 2 \
         --routing ${LAYER_ROUTING:-uniform} --steps 20 --warmup 5 --jsonl "$OUT/layer.jsonl"; done;;
  layer-ab) for mode in 1 0; do for e in ${LAYER_EXPERTS:-16 64}; do
       echo "--- MIXMOE_GROUPED_MM=$mode E=$e" >> "$OUT/layer-ab.log"
       MIXMOE_GROUPED_MM=$mode timeout "${LAYER_S:-60}" $PY -m mixmoe bench layer --device cuda --dtype bf16 \
         --model-dim 1024 --hidden-size 4096 --tokens 8192 --num-local-experts $e --top-k 2 \
         --routing ${LAYER_ROUTING:-uniform} --steps 20 --warmup 5 --jsonl "$OUT/layer.jsonl" 2>&1 \
         | grep -v "^STEP" >> "$OUT/layer-ab.log"; done; done
       echo "=== layer-ab ($(date +%T))"; grep -A4 "^---\|^strategy" "$OUT/layer-ab.log" | grep "^---\|^local";;
  hf-ab) for mode in 1 0; do echo "--- MIXMOE_GROUPED_MM=$mode" >> "$OUT/hf.log"
       MIXMOE_GROUPED_MM=$mode timeout "${HF_S:-120}" $PY scripts/gpu/hf_mixtral_vs_mixmoe.py --experts ${HF_EXPERTS:-16,64} >> "$OUT/hf.log" 2>&1; done
       echo "=== hf-ab ($(date +%T))"; tail -n 30 "$OUT/hf.log";;
  hf-bench) run hf-bench "${HF_S:-240}" $PY -m mixmoe bench hf --world-size 1 --device cuda --dtype bf16 \
       --hidden-size 1024 --intermediate-size 4096 --num-experts ${HF_E:-16} --layers 2 --heads 16 \
       --batch 8 --seq-len 1024 --implementations eager,grouped_mm,mixmoe --steps 10 --warmup 3 --markdown;;
  calibrate) run calibrate "${CAL_S:-300}" $PY -m torch.distributed.run --nproc-per-node 1 -m mixmoe \
       calibrate --device cuda --world-size 1 --out "$OUT/gpu1.json"
       run validate-1gpu "${VAL_S:-300}" $PY -m mixmoe simulate --validate "$OUT/one.jsonl" --remeasure \
         --validate-world 1 --device cuda;;
  hf) run hf "${HF_S:-240}" $PY scripts/gpu/hf_mixtral_vs_mixmoe.py --experts ${HF_EXPERTS:-4,16,64};;
  *) echo "unknown stage $stage"; exit 2;;
esac; done

#!/usr/bin/env bash
# The checks a session with a lent GPU runs, from the repository root, one device call per part:
#   (main, about 5 minutes on an H100 / H200, under 9 by its timeouts) seconds per steady round of the flagship
#   (recipes/ondevice_kd_cifar10.yaml) and of a batchable paper recipe (recipes/fedavg_cifar10_table5.yaml), each
#   sequential, sequential with CUDA graphs (runtime.cuda_graphs, a process of its own per recipe: a bad capture can
#   end the process) and lockstep (runtime.lockstep; the batched modes run optimizer_state shared_per_phase), 32-true,
#   with GPU utilisation, peak memory and the first round's extra seconds, next to the plain-PyTorch anchors timed in
#   the same process (sequential, sequential replayed from one CUDA graph, vmapped) priced per recipe. Lockstep with
#   CUDA graphs is not measured: a capture of the whole vmapped step is not built.
#   Run it with PYTHONUNBUFFERED=1 so that a run cut short still shows what it reached.
# The device image lacks jsonargparse and friends: their wheels travel in .whl/ (carry: [".whl"]).
#   bash benchmarks/gpu_check.sh            # writes $OUT/ (or ./gpu_check_out/) and prints a summary
#   TINY=1 bash benchmarks/gpu_check.sh     # a CPU dry run of the same script (tiny runs; tests collected, not run)
#   EXECUTORS="sequential lockstep batched" bash benchmarks/gpu_check.sh   # also the batched executor by shape
#   PART=tests bash benchmarks/gpu_check.sh     # a second call (at most 9 minutes by its timeouts): CUDA graphs
#                                               # against eager, every digits recipe on CUDA, precision, parity of
#                                               # batched and lockstep runs against sequential ones
#   PART=profile bash benchmarks/gpu_check.sh   # profiles of a graphed and a lockstep flagship run of 2 rounds
#   PART=compile bash benchmarks/gpu_check.sh   # (about 4 minutes): the plain vmapped step under torch.compile,
#                                               # default and reduce-overhead (CUDA graphs)
#   PART=probe bash benchmarks/gpu_check.sh     # if those paid: the batched executor's step compiled
#   BUDGET_S=570 bash benchmarks/gpu_check.sh   # then the compile part too, if BUDGET_S leaves it 240 s or more
set -euo pipefail
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import jsonargparse" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=${PYTHONPATH:-}:$PWD
fi
export WANDB_MODE=offline
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"
if [ "${PART:-main}" = compile ]; then
  python3 benchmarks/gpu_flagship.py ${TINY:+--tiny} --skip_runs --compile default reduce-overhead --json \
    > "$OUT/gpu_compile.json"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['device']); [print(p) for p in r['plain_pytorch']]" \
    "$OUT/gpu_compile.json"
  exit 0
fi
if [ "${PART:-main}" = probe ]; then
  if [ -n "${TINY:-}" ]; then accelerator=cpu; else accelerator=cuda; fi
  python3 benchmarks/probes/compile_probe.py --accelerator "$accelerator" --mode default reduce-overhead \
    --rounds 3 --local_steps 16 --per_batch 2000 | tee "$OUT/compile_probe.jsonl"
  exit 0
fi
if [ "${PART:-main}" = tests ]; then
  # CUDA graphs against eager in a process of their own (as above), then every digits recipe and resumes on CUDA,
  # and parity (accelerator auto picks the GPU: batched and lockstep against sequential CUDA runs). On a CPU dry run
  # the tests are collected only: the default suite runs them there.
  collect=${TINY:+--collect-only}
  timeout 180 python3 -m pytest -q -p no:cacheprovider $collect tests/test_cuda.py -k cuda_graph 2>&1 | tail -15 \
    | tee "$OUT/tests_graphs.txt" || true
  timeout 200 python3 -m pytest -q -p no:cacheprovider $collect tests/test_cuda.py -k "not cuda_graph" \
    tests/test_padding.py tests/test_batched_units.py tests/test_precision.py 2>&1 | tail -15 | tee "$OUT/tests.txt" || true
  timeout 150 python3 -m pytest -q -p no:cacheprovider $collect tests/test_batched_executor.py \
    -k "same_weights or lockstep or record or bf16" 2>&1 \
    | tail -15 | tee "$OUT/tests_lockstep.txt" || true
  exit 0
fi
if [ "${PART:-main}" = profile ]; then
  # where a round goes, graphed and in lockstep (python3 -m pstats, or pstats.Stats(...).sort_stats("tottime"))
  if [ -n "${TINY:-}" ]; then shrink="--tiny"; else shrink=""; fi
  for executor in graphs lockstep; do
    timeout 150 python3 -m cProfile -o "$OUT/${executor}_round.prof" benchmarks/gpu_flagship.py $shrink --rounds 2 \
      --precision 32-true --executor $executor --skip_plain --json > /dev/null 2>&1 || echo "the $executor profile failed"
  done
  exit 0
fi
if [ -n "${TINY:-}" ]; then shrink="--tiny --rounds 3"; else shrink="--rounds 4"; fi
recipes="ondevice_kd_cifar10 fedavg_cifar10_table5"
for recipe in $recipes; do
  timeout 120 python3 benchmarks/gpu_flagship.py $shrink --recipe $recipe --precision 32-true --executor graphs \
    --skip_plain --json > "$OUT/gpu_graphs_$recipe.json" 2> >(tee "$OUT/gpu_graphs_$recipe.log" >&2) \
    || echo "the CUDA-graphs run of $recipe failed: $OUT/gpu_graphs_$recipe.log"
done
# bf16-mixed was slower than 32-true for ResNet20 at batch 32 (docs/performance.md): PRECISIONS="32-true bf16-mixed"
timeout 300 python3 benchmarks/gpu_flagship.py $shrink --recipe $recipes --precision ${PRECISIONS:-32-true} \
  --executor ${EXECUTORS:-sequential lockstep} --json > "$OUT/gpu_runs.json" 2> >(tee "$OUT/gpu_runs.log" >&2) \
  || echo "the sequential and lockstep runs did not finish: what they reached is in $OUT/gpu_runs.log"
python3 - "$OUT"/gpu_graphs_*.json "$OUT/gpu_runs.json" <<'EOF'
import json, sys
results = []
for path in sys.argv[1:]:
    try:
        results.append(json.load(open(path)))
    except (OSError, ValueError):
        print("no result in", path)
for result in results:
    print(result["device"], "torch", result["torch"])
    for run in result["runs"]:
        util = run["gpu_util_mean_pct"]
        peak = run["peak_gpu_mb"]
        print(f"{run['recipe']:>22} {run['executor']:>10} {run['precision']:>8}: {run['s_per_steady_round']:.2f} s per "
              f"steady round, first round +{run['first_round_extra_s']:.1f} s, GPU {util if util is None else round(util)}%, "
              f"peak {peak if peak is None else round(peak)} MB, fits {run['fits']}, final {run['final']}")
    for plain in result.get("plain_pytorch", []):
        print("plain", plain)
    for recipe, seconds in result.get("anchor_s_per_round", {}).items():
        print(f"{recipe:>22} plain anchors, s per round:", {k: v if v is None else round(v, 2) for k, v in seconds.items()})
EOF
# what the device call has left goes to the compile anchors (one call: a second one may find no warm machine)
if [ -n "${BUDGET_S:-}" ] && [ $((BUDGET_S - SECONDS)) -ge 240 ]; then
  PART=compile timeout $((BUDGET_S - SECONDS)) bash "$0" 2>&1 | tee "$OUT/compile.log" || true
fi

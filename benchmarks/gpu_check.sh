#!/usr/bin/env bash
# The checks a session with a lent GPU runs once (about 8 minutes on an H100 / H200), from the repository root:
#   the flagship benchmark (sequential with CUDA graphs in a process of its own, then sequential and batched;
#   32-true; next to the plain-PyTorch anchors, the CUDA-graphed one included), the tests on CUDA (CUDA graphs against eager, every digits recipe,
#   batched-executor parity, precision, start-up), then profiles of a graphed and a batched run of 2 rounds.
#   Run it with PYTHONUNBUFFERED=1 so that a run cut short still shows what it reached.
# The device image lacks jsonargparse and friends: their wheels travel in .whl/ (carry: [".whl"]).
#   bash benchmarks/gpu_check.sh            # writes $OUT/ (or ./gpu_check_out/) and prints a summary
#   TINY=1 bash benchmarks/gpu_check.sh     # a CPU dry run of the same script (tiny flagship)
#   PART=compile bash benchmarks/gpu_check.sh   # a second call (about 4 minutes): the plain vmapped step under
#                                               # torch.compile, default and reduce-overhead (CUDA graphs)
#   PART=probe bash benchmarks/gpu_check.sh     # a third call if those paid: the batched executor's step compiled
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
if [ -n "${TINY:-}" ]; then shrink="--tiny --rounds 3"; else shrink="--rounds 4"; fi
# CUDA graphs first, in a process of their own: the one mode never run on a GPU, and a failure there (a bad
# capture can end the process) must not take the other figures with it
python3 benchmarks/gpu_flagship.py $shrink --precision 32-true --executor graphs --skip_plain --json \
  > "$OUT/gpu_graphs.json" 2> >(tee "$OUT/gpu_graphs.log" >&2) || echo "the CUDA-graphs run failed: $OUT/gpu_graphs.log"
# bf16-mixed does not batch (docs/performance.md) and was slower sequentially: PRECISIONS="32-true bf16-mixed"
python3 benchmarks/gpu_flagship.py $shrink --precision ${PRECISIONS:-32-true} --executor sequential batched \
  --split benchmarks/results/batched_calls_flagship.json --json > "$OUT/gpu_flagship.json" 2> >(tee "$OUT/gpu_flagship.log" >&2)
python3 - "$OUT/gpu_graphs.json" "$OUT/gpu_flagship.json" <<'EOF'
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
        print(f"{run['executor']:>10} {run['precision']:>10}: {run['s_per_steady_round']:.2f} s per steady round, first "
              f"round +{run['first_round_extra_s']:.1f} s, GPU {run['gpu_util_mean_pct']}%, fits {run['fits']}, final {run['final']}")
    for plain in result.get("plain_pytorch", []):
        print("plain", plain)
    if "plain_split" in result:
        print("plain PyTorch in the batched executor's split:", round(result["plain_split"]["s_per_round"], 2), "s per round")
EOF
# the tests after the figures, which matter more if the device's time runs out: CUDA graphs against eager (in a
# process of their own, as above), then every digits recipe and resumes on CUDA, and parity (accelerator auto
# picks the GPU: batched against sequential CUDA runs)
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k cuda_graph 2>&1 | tail -15 | tee "$OUT/tests_graphs.txt" || true
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not cuda_graph" tests/test_batched_executor.py \
  tests/test_precision.py tests/test_startup.py 2>&1 | tail -15 | tee "$OUT/tests.txt" || true
if [ -z "${TINY:-}" ]; then
  # where a round goes, graphed and batched (python3 -m pstats, or pstats.Stats(...).sort_stats("tottime"))
  for executor in graphs batched; do
    timeout 120 python3 -m cProfile -o "$OUT/${executor}_round.prof" benchmarks/gpu_flagship.py --rounds 2 \
      --precision 32-true --executor $executor --skip_plain --json > /dev/null 2>&1 || true
  done
fi
# what the device call has left goes to the compile anchors (one call: a second one may find no warm machine)
if [ -n "${BUDGET_S:-}" ] && [ $((BUDGET_S - SECONDS)) -ge 240 ]; then
  PART=compile timeout $((BUDGET_S - SECONDS)) bash "$0" 2>&1 | tee "$OUT/compile.log" || true
fi

#!/usr/bin/env bash
# The GPU check: one call on one borrowed NVIDIA GPU, at most 5 minutes, offline, with only torch,
# torchvision, lightning, triton, cupy and pytest installed (gc_strategy runs from this checkout).
#
#   bash benchmarks/gpu_check.sh            # writes $OUT/gpu_check.md (or ./gpu_check.md)
#   GC_COMMIT=abc1234 bash benchmarks/gpu_check.sh   # names the commit where the copy has no git
#
# 1. the CUDA tests: every compressor on a CUDA bucket against the CPU, the Triton kernels, and a
#    synchronised step of every compressor and memory under torch.cuda.set_sync_debug_mode("error");
# 2. the time each configuration adds to a step over plain training, next to a second copy of plain
#    training (the control) and torch DDP alone and with its fp16, bf16 and PowerSGD hooks,
#    interleaved in one process: ResNet-50 (batch 64) in fp32 (every compressor) and under bf16
#    autocast, BERT-base (batch 32) in fp32 (benchmarks/step_overhead.py); in fp32 also a trace of
#    two steps of each configuration: the device's busy and idle time, the side stream's, the
#    synchroniser's host time and the CUDA runtime calls (--profile, benchmarks/step_profile.py);
# 3. the kernel layer's hot operations in each variant, torch, Triton and CuPy's counterparts
#    (benchmarks/kernel_variants.py);
# 4. compression costs of every compressor on ResNet-50's gradients in one bucket and in 25 MB
#    buckets (benchmarks/compression_costs.py; the side stream's top kernels are in part 2's trace).
# Each part has its own time limit, cut to what is left of the check's 290 s, so that one that
# hangs still leaves the others' results and the check ends within its 5 minutes. The step timings
# start no round after their --seconds (warm-up included), and one cut at its limit still reports
# the rounds it completed.
set -uo pipefail
cd "$(dirname "$0")/.."
report="${OUT:-.}/gpu_check.md"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # a part cut short keeps its output
python=python3

budget=290
part() {  # part TITLE SECONDS COMMAND...: run one part, its output fenced in the report
    local title=$1 seconds=$2
    shift 2
    local left=$((budget - SECONDS))
    ((seconds > left)) && seconds=$left
    if ((seconds < 10)); then
        echo "## $title: not run, the check's $budget s are spent" >>"$report"
        return
    fi
    echo "## $title" >>"$report"
    echo >>"$report"
    echo "\`$*\`" >>"$report"
    echo >>"$report"
    echo '```' >>"$report"
    local started=$SECONDS
    timeout -k 10 "$seconds" "$@" 2>&1 | tail -n 400 >>"$report"  # TERM, then KILL 10 s on
    local status=${PIPESTATUS[0]}
    echo '```' >>"$report"
    echo "exit status $status after $((SECONDS - started)) s (limit $seconds s)" >>"$report"
    echo >>"$report"
}

{
    echo "# GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%d)"
    echo "- commit: ${GC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"
    echo "- $($python -c 'import torch, triton; print(f"torch {torch.__version__}, Triton {triton.__version__}")' 2>&1)"
    echo "- $($python -c 'import cupy; print(f"CuPy {cupy.__version__}")' 2>&1 | tail -n 1)"
    echo
} >"$report"

compressors=(fp16 bf16 topk+residual randk+residual dgc+dgc efsignsgd+residual qsgd powersgd acpsgd)
every=("${compressors[@]}" topk+residual:chunk=256 threshold+residual sidco+residual onebit+residual signsgd signum terngrad natural)
part "CUDA tests" 70 $python -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cuda.py tests/kernels/test_triton_bits.py
# 12 warm-up steps: PowerSGD and ACP-SGD compress from their 11th
part "Time added to a ResNet-50 step (batch 64, fp32), and two steps of each traced" 95 \
    $python benchmarks/step_overhead.py --rounds 8 --steps 4 --warmup 12 --seconds 65 --profile \
    --compressors "${every[@]}"
part "Time added to a ResNet-50 step (batch 64, bf16 autocast)" 55 $python benchmarks/step_overhead.py \
    --autocast bf16 --rounds 8 --steps 4 --warmup 12 --seconds 40 --compressors "${compressors[@]}"
part "Time added to a BERT-base step (batch 32, fp32)" 55 $python benchmarks/step_overhead.py \
    --model bert-base --batch 32 --rounds 5 --steps 4 --warmup 12 --seconds 40 --compressors "${compressors[@]}"
part "Kernel variants on 25.6 M elements: torch, Triton and CuPy" 25 $python benchmarks/kernel_variants.py \
    --runs 5 --repeats 10
part "Compression costs on ResNet-50's gradients" 45 $python benchmarks/compression_costs.py \
    --device cuda --models resnet50 --plans single bucket_mb:25 --runs 3
echo "report: $report"

#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and torch + triton already installed (no
# .venv needed: the repository is imported as `fxpar` through a symlink).
#   bash benchmarks/gpu_checks.sh [LOG_DIR [PART ...]]
# The default parts (0 1) took 8-9 minutes on one H100 / H200 (a lease here is 15 minutes of device
# time, starts included); the others are opt-in. PARTs:
# 0. benchmarks/step_vs_eager.py, HF GPT-2 small bf16 (issue 27's target rows): eager,
#    torch.compile (default, reduce-overhead), fxpar codegen=auto (Inductor) with CUDA graphs
#    on/off, with remat="auto" (cheap ops recomputed, as torch.compile's partitioner does)
#    and with the cross-entropy in Inductor's closed form, fxpar codegen=eager with its
#    hand-written Triton kernels + CUDA graphs, each with its top kernels by GPU time (--profile, in the
#    log); and benchmarks/executor_overhead.py (host cost per node)
# 1. tests/test_gpu.py + the hand-written kernels' tests on the GPU (FXPAR_TEST_GPU=1)
# 2. benchmarks/planner_gpu.py: predicted vs measured step time / memory, fxpar vs eager vs
#    torch.compile, fp32 and bf16, fused and unfused, with a profile of the bf16 step
# 3. benchmarks/fused_kernels.py --gpu-only: each kernel's bandwidth, fxpar vs eager vs compile
# 4. benchmarks/step_vs_eager.py, every row: GPT-2 small and a small Llama, fp32 and bf16,
#    every fxpar variant (over 10 minutes: run it as `... 4` in a call of its own)
# 5. benchmarks/step_vs_eager.py, Llama bf16: reduce-overhead vs fxpar with and without
#    remat="auto" (whether cheap-op recompute should be the default under Inductor on GPUs;
#    a cold compile of these rows took over 140 s on an H200: give it 300)
# 6. benchmarks/first_steps.py at Qwen2.5-0.5B's depth, width and vocabulary (24 x 896, a
#    151,936-token tied head,
#    batch 8 x 1024, fp32): time to the first step and the first steps' vs a steady step's
#    peak, eager vs torch.compile vs fxpar (issue 49's targets; not yet run on a GPU)
# 7. benchmarks/offload_optimizer.py: Plan.offload_optimizer vs the optimizer on the GPU
#    (step time, device memory held, losses; a 110M GPT, fp32 AdamW; not yet run on a GPU)
# 8. benchmarks/first_steps.py --model mixtral: a 6-layer Mixtral-style MoE at width 1024
#    (8 experts, top-2, ~390M parameters, batch 8 x 1024, fp32; issue 49's MoE row; not yet
#    run on a GPU)
set -u
PY=${PYTHON:-python3}
mkdir -p "${1:-gpu_logs}" /tmp/fxpar_import
LOGS=$(cd "${1:-gpu_logs}" && pwd)
ln -sfn "$(cd "$(dirname "$0")/.." && pwd)" /tmp/fxpar_import/fxpar
export PYTHONPATH=/tmp/fxpar_import${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
shift 2>/dev/null; PARTS=" ${*:-0 1} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$LOGS/gpu.txt"
if part 0; then
timeout 400 $PY benchmarks/step_vs_eager.py --model gpt2 --precision bf16 --steps 15 --profile --only \
    "torch.compile,torch.compile reduce-overhead,fxpar codegen=auto graphs=on,fxpar codegen=auto graphs=off,fxpar codegen=auto remat=auto graphs=on,fxpar codegen=auto ce=closed graphs=on,fxpar codegen=eager fuse=on graphs=on" \
    > "$LOGS/step_vs_eager_gpt2_bf16.log" 2>&1
grep -v "Warning\|warn(" "$LOGS/step_vs_eager_gpt2_bf16.log" | grep -A12 "^gpt2 "
# a compiled run the first-call check sent back to op by op, or one Inductor refused
grep "differs from the graph\|refused\|codegen joint" "$LOGS/step_vs_eager_gpt2_bf16.log" | cut -c1-240
timeout 60 $PY benchmarks/executor_overhead.py 2>&1 | tee "$LOGS/executor_overhead.log" | tail -6
fi
if part 1; then
FXPAR_TEST_GPU=1 timeout 300 $PY -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
    tests/test_gpu.py tests/test_kernels.py 2>&1 | grep -v "registered at\|fallthrough" \
    > "$LOGS/tests.log"; tail -15 "$LOGS/tests.log"
fi
if part 2; then
timeout 240 $PY benchmarks/planner_gpu.py --limit 3 --steps 5 > "$LOGS/planner_gpu.log" 2>&1
timeout 120 $PY benchmarks/planner_gpu.py --limit 1 --steps 5 --no-fuse --precision bf16 \
    --profile > "$LOGS/planner_gpu_unfused.log" 2>&1
grep -h "==\|predicted\|error\|fxpar (\|eager \|torch.compile " "$LOGS"/planner_gpu*.log
fi
if part 3; then
timeout 150 $PY benchmarks/fused_kernels.py --gpu-only 2>&1 | tee "$LOGS/fused_kernels.log" | tail -12
fi
if part 5; then
timeout 290 $PY benchmarks/step_vs_eager.py --model llama --precision bf16 --steps 15 --only \
    "torch.compile reduce-overhead,fxpar codegen=auto graphs=on,fxpar codegen=auto remat=auto graphs=on" \
    > "$LOGS/step_vs_eager_llama_bf16.log" 2>&1
grep -v "Warning\|warn(" "$LOGS/step_vs_eager_llama_bf16.log" | grep -A6 "^llama "
fi
if part 4; then
timeout 590 $PY benchmarks/step_vs_eager.py --steps 15 2>&1 | grep -v "Warning\|transformers" \
    | tee "$LOGS/step_vs_eager.log" | tail -40
fi
if part 6; then
timeout 500 $PY benchmarks/first_steps.py --layers 24 --width 896 --vocab 151936 --batch 8 \
    --seq 1024 2>&1 | tee "$LOGS/first_steps.log" | tail -6
fi
if part 7; then
timeout 300 $PY benchmarks/offload_optimizer.py 2>&1 | tee "$LOGS/offload_optimizer.log" | tail -5
fi
if part 8; then
timeout 400 $PY benchmarks/first_steps.py --model mixtral --layers 6 --width 1024 --batch 8 \
    --seq 1024 2>&1 | tee "$LOGS/first_steps_moe.log" | tail -6
fi

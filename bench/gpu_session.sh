#!/usr/bin/env bash
# One lent-GPU session, as one command (the device tool; see BENCHMARKS.md "GPU"): from the repository root on
# the GPU machine, with the inputs `python bench/engine_gpu.py --prepare .gpu` wrote here carried along:
#
#     OUT=/where/results/go bash bench/gpu_session.sh STAGE...
#
# Time limits per stage (seconds) from the environment: TESTS_LIMIT, KERNELS_LIMIT, ENGINE_LIMIT, PY_LIMIT. The
# 15 minutes of a lent device fit two calls after the machine's start (~110 s): `kernels engine8b` (~500 s: the
# figures the open goals need first), then `tests` (a fresh machine spends ~170 s compiling before its results).
#
# Stages: tests (the Triton kernel tests, QLinear's CUDA test, a decode-graph capture and replay and the fused MoE
# block of five MoE families, compiled for the GPU: TRITON_INTERPRET=0),
# kernels (bench/gpu_kernels.py --quick), engine (bench/engine_gpu.py on the SmolLM2-135M shape: attention check, bf16,
# W4, W8; ENGINE_ARGS=--profile adds a cProfile of each), engine8b (the Llama-3-8B shape: bf16, W4, W8); both
# print each engine's step table at batch 1, 8, 64 (GPU busy time, the host's remainder, the memory floor),
# py:FILE (python3 .gpu/FILE: a one-off diagnosis carried with the inputs).
# Each stage runs under its own time limit and writes OUT/<stage>.log (and .json); a stage that fails or runs out
# of time does not stop the next. The machine has the image's torch/triton/transformers but no pip access, so the
# package runs from a staged copy in its installed layout (quantkit.serve = serve/, ...), not an install.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
INPUTS=$(pwd)/.gpu
STAGE_DIR=/tmp/quantkit_stage
rm -rf "$STAGE_DIR" && mkdir -p "$STAGE_DIR"
cp -r quantkit tests bench pyproject.toml "$STAGE_DIR"/
for sub in serve kernels evals; do cp -r "$sub" "$STAGE_DIR/quantkit/$sub"; done
cd "$STAGE_DIR"
export PYTHONPATH=$STAGE_DIR PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: limit ${limit} s"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 30 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
for arg in "$@"; do
    case $arg in
        tests) stage tests "${TESTS_LIMIT:-240}" python3 -m pytest -q -rf -p no:cacheprovider \
                   tests/serve/test_cuda_graphs.py::test_graph_replay_equals_the_eager_padded_forward \
                   tests/serve/test_cuda_graphs.py::test_engine_greedy_with_graphs_equals_eager \
                   tests/quantkit/test_qlinear.py::test_cuda_forward_matches_reference_and_keeps_the_qtensor \
                   tests/serve/test_cuda_linear.py \
                   tests/kernels/test_kernels_attention.py tests/kernels/test_triton_window_softcap.py \
                   tests/kernels/test_kernels_fused.py tests/kernels/test_triton_layer_ops.py \
                   tests/kernels/test_kernels_compile.py \
                   "tests/kernels/test_triton_fused_moe.py::test_fused_block_equals_moe_forward_with_the_same_state" \
                   tests/kernels/test_kernels_qgemm.py ;;  # the slowest to compile last
        kernels) stage kernels "${KERNELS_LIMIT:-200}" python3 bench/gpu_kernels.py --quick --out "$OUT/kernels.json" ;;
        engine) stage engine "${ENGINE_LIMIT:-200}" python3 bench/engine_gpu.py --inputs "$INPUTS" \
                    --shapes smollm2-135m --out "$OUT/engine.json" ${ENGINE_ARGS:-} ;;
        engine8b) stage engine8b "${ENGINE_LIMIT:-300}" python3 bench/engine_gpu.py --inputs "$INPUTS" \
                      --shapes llama3-8b --schemes bf16,w4,w8 --out "$OUT/engine8b.json" ;;
        py:*) stage "$(basename "${arg#py:}" .py)" "${PY_LIMIT:-150}" python3 "$INPUTS/${arg#py:}" ;;
        *) echo "unknown stage $arg"; exit 2 ;;
    esac
done

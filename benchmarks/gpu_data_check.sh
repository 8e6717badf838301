#!/usr/bin/env bash
# The data check on a lent GPU machine in one call of about 9.5 minutes: the ImageNet recipes' loader,
# model-alone and end-to-end speeds (benchmarks/data.md's GPU table), their hand-over parts, our
# augmentation kernels against kornia's and torchvision's (data.md), the speed of one EVA-family and
# one NaFlex model against timm's (gpu.md), and the GPU's name, into $OUT. First, here:
# `bash benchmarks/gpu_wheels.sh` (the wheels the machine lacks, into .whl/); then on the machine,
# carrying .whl: `bash benchmarks/gpu_data_check.sh`.
# Each step has its own time limit, so one that hangs leaves the others' tables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vit-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1
nproc >>"$OUT/gpu.csv"
IMAGES=${IMAGES:-4000}  # ImageNet-like JPEGs of 500x375 in 100 classes (and a tenth as many to validate)
tree=/tmp/vit-tree-$IMAGES  # written here, not carried
python3 -c "from vit.tools.data_check import write_synthetic_imagenet as w; print(w('$tree', $IMAGES, $IMAGES // 10, 100))" \
  >"$OUT/tree.txt" 2>&1
check=(python3 scripts/gpu_check.py --checks data --data-root "$tree" --data-steps 40 --data-warmup 10)
# The recipes feed the model from a data process on a GPU; each also with the work in the training process.
timeout 250 "${check[@]}" --data-recipes configs/imagenet_vit_b16.yaml --data-variants data.data_process=false,streaming \
  --json "$OUT/vit_b16.json" >"$OUT/vit_b16.txt" 2>&1
echo "vit_b16 exit $?" >>"$OUT/status.txt"
timeout 130 "${check[@]}" --data-recipes configs/imagenet_resnet50.yaml --data-variants data.data_process=false \
  --json "$OUT/resnet50.json" >"$OUT/resnet50.txt" 2>&1
echo "resnet50 exit $?" >>"$OUT/status.txt"
timeout 60 python3 -m benchmarks.data_parts --root "$tree" >"$OUT/data_parts.txt" 2>&1
echo "data_parts exit $?" >>"$OUT/status.txt"
# each row is printed as it is measured: a run cut short keeps those done
timeout 45 python3 -m benchmarks.data_kernels --device cuda --cases ImageNet-like --reps 2 \
  --json "$OUT/data_kernels.json" >"$OUT/data_kernels.txt" 2>&1
echo "data_kernels exit $?" >>"$OUT/status.txt"
# timm's own model of each name beside ours, bf16 autocast; an older timm without the name fails this row only.
timeout 70 python3 scripts/benchmark.py --device cuda --dtype bf16 --sections vit --reps 3 \
  --models vit_small_patch16_dinov3:256:128,naflexvit_base_patch16_gap:128:64 --out "$OUT/families" \
  >"$OUT/families.txt" 2>&1
echo "families exit $?" >>"$OUT/status.txt"
# a data process that could not serve the training process left its rows to it: say so
grep -l "the data process cannot serve the training process" "$OUT"/*.txt | sed 's/^/data process fell back in: /' >>"$OUT/status.txt"
cat "$OUT/status.txt"

#!/usr/bin/env bash
# one device call: data parts, the ViT-B/16 data check with variants, then ResNet-50 with what is left
T0=$(date +%s); END=$((T0 + ${BUDGET:-580}))
left() { echo $((END - $(date +%s))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt; python3 -c "import torch;print(torch.__version__, torch.version.cuda)" >> $OUT/gpu.txt
python3 -c "from vit.tools.data_check import write_synthetic_imagenet as w; print(w('/tmp/vit-tree', 4000, 400, 100))" > $OUT/tree.txt 2>&1
echo "tree $(( $(date +%s) - T0 )) s" >> $OUT/times.txt
timeout -k 5 70 python3 -m benchmarks.data_parts --root /tmp/vit-tree --worker-decode 0 > $OUT/parts0.md 2>&1
echo "parts0 $(( $(date +%s) - T0 )) s" >> $OUT/times.txt
timeout -k 10 $(( $(left) - 150 )) python3 scripts/gpu_check.py --checks data --data-recipes configs/imagenet_vit_b16.yaml --data-variants worker-decode0.5,cap320 --data-steps 40 --data-warmup 10 --data-root /tmp/vit-tree --json $OUT/vit.json > $OUT/vit.log 2>&1
echo "vit $(( $(date +%s) - T0 )) s" >> $OUT/times.txt
timeout -k 5 50 python3 -m benchmarks.data_parts --root /tmp/vit-tree --worker-decode 1 > $OUT/parts1.md 2>&1
echo "parts1 $(( $(date +%s) - T0 )) s" >> $OUT/times.txt
timeout -k 10 $(( $(left) - 10 )) python3 scripts/gpu_check.py --checks data --data-recipes configs/imagenet_resnet50.yaml --data-variants worker-decode0.5 --data-steps 40 --data-warmup 10 --data-root /tmp/vit-tree --json $OUT/resnet.json > $OUT/resnet.log 2>&1
echo "resnet $(( $(date +%s) - T0 )) s" >> $OUT/times.txt
cat $OUT/times.txt; grep -h "data-check\]" $OUT/vit.log $OUT/resnet.log; tail -12 $OUT/parts0.md $OUT/parts1.md

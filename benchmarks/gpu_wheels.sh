#!/usr/bin/env bash
# The wheels a GPU machine without our extra packages needs for `scripts/gpu_check.py --checks data`
# (albumentations, jsonargparse, pydantic, litdata and their dependencies) and benchmarks/data_kernels.py
# (kornia), at the versions of this checkout's .venv, for Python 3.12, into .whl/ (ignored by git). On
# the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
packages=(albumentations albucore simsimd stringzilla pydantic pydantic-core annotated-types typing-inspection
  jsonargparse docstring-parser typeshed-client litdata boto3 botocore s3transfer jmespath obstore kornia kornia_rs)
pins=()
for name in "${packages[@]}"; do
  pins+=("$name==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl
du -sh .whl

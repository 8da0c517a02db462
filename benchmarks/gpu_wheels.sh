#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has jax, flax, optax, orbax, torch, transformers and no
# network), fetched here for its Python 3.12 / x86-64, into .whl/ (git-ignored) so a device call
# can carry them:  bash benchmarks/gpu_wheels.sh   then carry ".whl" with the call.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# The runtime dependencies missing from the GPU image, and what they need in turn.
for pkg in grain fastapi starlette uvicorn pydantic pydantic-core annotated-types \
           typing-inspection tensorboardX openai distro jiter sniffio array-record dm-tree; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "$pkg"
done
ls -la .whl
du -sh .whl

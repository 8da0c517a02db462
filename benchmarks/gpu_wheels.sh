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
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "$@"
}
for pkg in grain fastapi starlette uvicorn pydantic annotated-types \
           typing-inspection tensorboardX openai distro jiter sniffio array-record dm-tree; do
  fetch "$pkg"
done
# The editable install of this checkout builds with whatever setuptools it finds first on the
# path; one older than 70.1 cannot build a wheel without the `wheel` package, which a Python
# 3.12 image need not have. A recent setuptools comes along (on PYTHONPATH from /tmp/site).
fetch setuptools
# pydantic needs one exact pydantic-core: the one its metadata names, not the newest.
core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' |
       sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
fetch "pydantic-core==${core:?pydantic names no pydantic-core version}"
# Flax as rehearsed with the image's jax 0.11.2 (docs/benchmarks.md): the image's own flax is
# of a version nobody has read, and releases before 0.12.8 lack APIs the package uses.
fetch "flax==0.12.12"
ls -la .whl
du -sh .whl

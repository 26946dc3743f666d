# Sourced by the GPU scripts from the repository root: tigon importable from this checkout (as tigon.kernels, ...)
# without installing it, and on a GPU machine the wheels carried in .whl/ (pydantic, DeepSpeed, Liger-Kernel) and in
# any .whl-*/ beside it (e.g. .whl-flyte/: flytekit and its needs, for the workflow's GPU test; .whl-tf/: a newer
# transformers than the image's, for Gemma 4).
mkdir -p /tmp/tigonpath/tigon
for layer in kernels runtime platform; do ln -sfn "$PWD/$layer" "/tmp/tigonpath/tigon/$layer"; done
export PYTHONPATH="/tmp/tigonpath:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi > /dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  shopt -s nullglob
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    .whl-*/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

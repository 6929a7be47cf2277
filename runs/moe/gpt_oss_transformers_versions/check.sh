#!/bin/bash
# The gpt-oss equivalence tests against an older transformers, installed apart (the project's
# own stays as it is). Usage: bash runs/moe/gpt_oss_transformers_versions/check.sh 5.17.0
set -euo pipefail
v=${1:?transformers version}
target=/tmp/transformers-$v
pip install -q --upgrade --no-deps --target "$target" "transformers==$v" "huggingface-hub>=1.5.0,<2.0" > /dev/null 2>&1 \
    || { echo "pip could not install transformers==$v into $target"; exit 1; }
echo "transformers $(PYTHONPATH=$target python -c 'import transformers; print(transformers.__version__)'), host $(hostname), $(date -u +%FT%TZ)"
PYTHONPATH=$target python -m pytest -q -p no:cacheprovider tests/test_gpt_oss.py tests/test_moe.py \
    tests/test_model_families.py -k gpt 2>&1 | tail -8

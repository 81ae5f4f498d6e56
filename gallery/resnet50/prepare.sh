#!/usr/bin/env bash
# Mock ImageNet-1k-like data for the ResNet-50 recipe (the example's `bash prepare.sh`).
#   bash gallery/resnet50/prepare.sh [OUT_DIR] [NUM_IMAGES]
# then: python launch_single_task.py --data OUT_DIR ...
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-data/mock_imagenet}"
NUM_IMAGES="${2:-5000}"
python -m gallery.resnet50.data prepare --out "$OUT" --num-images "$NUM_IMAGES"

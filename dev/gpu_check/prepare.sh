#!/usr/bin/env bash
# Run here (the CPU machine): torch 2.14.1 and torchvision 0.29.1 for the device's Python 3.12,
# packed into parts that each fit one device call's 64 MiB carry limit, under .gpu/ (ignored).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.gpu/" >> .git/info/exclude; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # about 2 GB while it runs
for pkg in torch==2.14.1 torchvision==0.29.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$work" "$pkg"
done
mkdir -p "$work/tree" .gpu/tv && (cd "$work/tree" && unzip -q "$work"/torch-*.whl)
rm -rf "$work/tree/torch/include" "$work/tree/torch/bin" "$work/tree/torch/share"  # not imported
tar cf - -C "$work/tree" . | xz -T2 -6 > "$work/torch.tar.xz"
rm -rf .gpu/p[0-9]* && split -b 56000000 -d -a 1 "$work/torch.tar.xz" "$work/part"
for part in "$work"/part[0-9]; do i=${part##*part}; mkdir -p ".gpu/p$i"; mv "$part" ".gpu/p$i/"; done
mv "$work"/torchvision-*.whl .gpu/tv/ && cp dev/gpu_check/check.sh dev/gpu_check/stub.sh .gpu/
ls .gpu

#!/usr/bin/env bash
# Run on the device: /tmp/stub/libmissing.so defines every symbol of the CUDA libraries' own
# prefixes that torch 2.14.1 references and the image's (older) libraries lack (on 2026-11-26:
# 11 NCCL functions, none of which a single-GPU run calls), so torch can be loaded at all.
set -u
SP=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p /tmp/stub
libs=$(ls /tmp/site/torch/lib/*.so*)
deps=$(find "$SP/nvidia" -name "*.so*" -type f)
for f in $libs; do nm -D "$f" 2>/dev/null | awk '$1=="U"{print $2}'; done | sed 's/@.*//' |
  sort -u > /tmp/stub/undef
for f in $libs $deps; do nm -D --defined-only "$f" 2>/dev/null | awk '{print $NF}'; done |
  sed 's/@.*//' | sort -u > /tmp/stub/def
# only these prefixes: the driver API (cu*), libc and Python's C API come from elsewhere
comm -23 /tmp/stub/undef /tmp/stub/def |
  grep -E "^(nccl|cudnn|cusparseLt|nvshmem|cublas|cufft|curand|cusolver|nvrtc|cufile)" \
  > /tmp/stub/missing
echo "stubbed symbols: $(tr '\n' ' ' < /tmp/stub/missing)"
awk '{print "void " $1 "(void) {}"}' /tmp/stub/missing > /tmp/stub/missing.c
gcc -shared -fPIC -o /tmp/stub/libmissing.so /tmp/stub/missing.c

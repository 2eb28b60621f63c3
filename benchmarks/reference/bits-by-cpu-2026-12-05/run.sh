#!/bin/bash
# The gradient digest under each dispatcher's switch (run from the repository root).
for e in "" "ATEN_CPU_CAPABILITY=avx2" "ATEN_CPU_CAPABILITY=default" "MKL_CBWR=AVX2" "MKL_CBWR=AVX512" \
         "MKL_CBWR=COMPATIBLE" "MKL_ENABLE_INSTRUCTIONS=AVX2" "ONEDNN_MAX_CPU_ISA=AVX2" \
         "ONEDNN_MAX_CPU_ISA=AVX512_CORE" "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"; do
  echo "${e:-(none)}: $(env $e .venv/bin/python benchmarks/reference/bits-by-cpu-2026-12-05/gradient_bits.py)"
done

"""What is proven on CUDA (on the lent GPU, or for tree attention also in tests/helpers/cuda_emulator.py)
carries over to Metal only while each kernel's two bodies match line for line: every line, once
the CUDA spellings are replaced by Metal's, must be the Metal line (comments aside)."""

from importlib import resources

import pytest

from mlx_hybrid.kernels import kernel_source

SHARED = [("expf(", "metal::exp("), ("logf(", "metal::log(")]
BEAM_TOPK = [
    ("threadIdx.x", "thread_position_in_threadgroup.x"),
    ("blockIdx.x", "threadgroup_position_in_grid.x"),
    ("blockIdx.y", "threadgroup_position_in_grid.y"),
    ("__shared__ ", "threadgroup "),
    ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
    ("fmaxf(", "metal::max("),
]
SPELLINGS = {
    "pack_beams": [
        ("threadIdx.x", "thread_position_in_threadgroup.x"),
        ("__shared__ ", "threadgroup "),
        ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
    ],
    "selective_scan": [
        ("blockIdx.x * blockDim.x + threadIdx.x", "thread_position_in_grid.x"),
        ("blockIdx.y * blockDim.y + threadIdx.y", "thread_position_in_grid.y"),
    ],
    "ssm_step": [
        ("blockIdx.x * blockDim.x + threadIdx.x", "thread_position_in_grid.x"),
        ("blockIdx.y * blockDim.y + threadIdx.y", "thread_position_in_grid.y"),
        ("__shfl_xor_sync(0xffffffff, yt, m)", "simd_shuffle_xor(yt, static_cast<ushort>(m))"),
    ],
    "dsla_step": [
        ("blockIdx.x", "threadgroup_position_in_grid.x"),
        ("blockIdx.y", "threadgroup_position_in_grid.y"),
        ("threadIdx.x", "thread_position_in_threadgroup.x"),
        ("__shared__ ", "threadgroup "),
        ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
        ("__shfl_xor_sync(0xffffffff, o1, m)", "simd_shuffle_xor(o1, static_cast<ushort>(m))"),
        ("__shfl_xor_sync(0xffffffff, o2, m)", "simd_shuffle_xor(o2, static_cast<ushort>(m))"),
        ("__shfl_xor_sync(0xffffffff, ss, m)", "simd_shuffle_xor(ss, static_cast<ushort>(m))"),
        ("rsqrtf(", "metal::rsqrt("),
    ],
    "beam_topk_chunks": BEAM_TOPK,
    "beam_topk_merge": BEAM_TOPK,
    "greedy_accept": [
        ("threadIdx.x", "thread_position_in_threadgroup.x"),
        ("__shared__ ", "threadgroup "),
        ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
    ],
    "row_matmul": [
        ("threadIdx.x", "thread_position_in_threadgroup.x"),
        ("blockIdx.x", "threadgroup_position_in_grid.x"),
        ("__shfl_xor_sync(0xffffffff, ss, o)", "simd_shuffle_xor(ss, static_cast<ushort>(o))"),
        ("__shfl_xor_sync(0xffffffff, acc[m][c], o)", "simd_shuffle_xor(acc[m][c], static_cast<ushort>(o))"),
        ("rsqrtf(", "metal::rsqrt("),
        ("__int_as_float(", "as_type<float>("),
    ],
    "qrow_matmul": [
        ("threadIdx.x", "thread_position_in_threadgroup.x"),
        ("blockIdx.x", "threadgroup_position_in_grid.x"),
        ("__shfl_xor_sync(0xffffffff, acc[m][c], o)", "simd_shuffle_xor(acc[m][c], static_cast<ushort>(o))"),
    ],
    "tree_attention": [
        ("blockIdx.x", "threadgroup_position_in_grid.x"),
        ("threadIdx.x", "thread_position_in_threadgroup.x"),
        ("__shared__ ", "threadgroup "),
        ("__syncthreads();", "threadgroup_barrier(mem_flags::mem_threadgroup);"),
        ("__shfl_xor_sync(0xffffffff, s[r][b], o)", "simd_shuffle_xor(s[r][b], static_cast<ushort>(o))"),
        ("__shfl_xor_sync(0xffffffff, m[r], o)", "simd_shuffle_xor(m[r], static_cast<ushort>(o))"),
        ("__shfl_xor_sync(0xffffffff, l[r], o)", "simd_shuffle_xor(l[r], static_cast<ushort>(o))"),
        ("__shfl_xor_sync(0xffffffff, ov[r][e], o)", "simd_shuffle_xor(ov[r][e], static_cast<ushort>(o))"),
        ("cosf(", "metal::cos("),
        ("sinf(", "metal::sin("),
        ("__int_as_float(", "as_type<float>("),
    ],
}


@pytest.mark.parametrize("kernel", sorted(SPELLINGS))
def test_kernel_twins_stay_parallel(kernel):
    src = resources.files("mlx_hybrid.metal_kernels")
    cu = src.joinpath(kernel + ".cu").read_text().splitlines()
    metal = src.joinpath(kernel + ".metal").read_text().splitlines()
    assert len(cu) == len(metal)
    for i, (a, b) in enumerate(zip(cu, metal), 1):
        if a.startswith("//"):
            continue
        for old, new in SPELLINGS[kernel] + SHARED:
            a = a.replace(old, new)
        assert a == b, f"{kernel} line {i} differs beyond the CUDA/Metal spellings"


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_kernel_source_drops_comments_and_keeps_lines(backend):
    suffix = {"cuda": ".cu", "metal": ".metal"}[backend]
    for kernel in sorted(SPELLINGS):
        raw = resources.files("mlx_hybrid.metal_kernels").joinpath(kernel + suffix).read_text().splitlines()
        lines = kernel_source(backend, kernel).splitlines()
        assert len(lines) == len(raw) and "//" not in "\n".join(lines)
        assert [line.split("//")[0].strip() for line in raw] == lines

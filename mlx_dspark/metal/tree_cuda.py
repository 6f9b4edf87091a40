"""CUDA twin of the Metal tree-attention kernel (same inputs, launch and math).

One block per (batch, q-head, query node); each warp walks the key axis with
stride NSIMD keeping an online softmax, warps are merged in shared memory.
Importable without MLX: the CuPy harness uses it on machines without MLX.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from .layout import INPUT_NAMES, NSIMD, OUTPUT_NAMES, launch_args

if TYPE_CHECKING:
    import mlx.core as mx

CUDA_HEADER = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace dspark {
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
}  // namespace dspark
"""

# T, D and NSIMD arrive as `using T = ...; constexpr int D = ...;` lines that
# MLX writes at the top of the body. params as in the Metal kernel.
CUDA_SOURCE = """
    constexpr int LANE_ELEMS = D / 32;
    const float NEG_BIG = -3.0e38f;

    __shared__ float tg_m[NSIMD];
    __shared__ float tg_l[NSIMD];
    __shared__ float tg_acc[NSIMD * D];

    const int B = params[0];
    const int HQ = params[1];
    const int HKV = params[2];
    const int N = params[3];
    const int L = params[4];
    const int W = params[5];
    const int P = L - N;

    const int node = blockIdx.y;
    const int bh = blockIdx.z;
    // Whole blocks are launched: the guards are uniform per block, so no
    // thread is left waiting at a barrier.
    if (node >= N || bh >= B * HQ || threadIdx.x >= NSIMD * 32) {
        return;
    }
    const int b = bh / HQ;
    const int kvh = (bh % HQ) / (HQ / HKV);
    const int sg = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const float sc = scale[0];

    const T* qrow = q + ((size_t)bh * N + node) * D;
    const T* kbase = k + (size_t)(b * HKV + kvh) * L * D;
    const T* vbase = v + (size_t)(b * HKV + kvh) * L * D;
    const uint32_t* mrow = bitmask + (size_t)b * params[6] + (size_t)node * W;

    float qv[LANE_ELEMS];
    float acc[LANE_ELEMS];
    #pragma unroll
    for (int r = 0; r < LANE_ELEMS; ++r) {
        qv[r] = sc * dspark::to_float(qrow[r * 32 + lane]);
        acc[r] = 0.0f;
    }
    float m = NEG_BIG;
    float l = 0.0f;

    for (int j = sg; j < L; j += NSIMD) {
        const int t = j - P;
        if (t >= 0 && ((mrow[t >> 5] >> (t & 31)) & 1u) == 0u) {
            continue;
        }
        const T* krow = kbase + (size_t)j * D;
        float s = 0.0f;
        #pragma unroll
        for (int r = 0; r < LANE_ELEMS; ++r) {
            s += qv[r] * dspark::to_float(krow[r * 32 + lane]);
        }
        s = dspark::warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float corr = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = l * corr + p;
        const T* vrow = vbase + (size_t)j * D;
        #pragma unroll
        for (int r = 0; r < LANE_ELEMS; ++r) {
            acc[r] = acc[r] * corr + p * dspark::to_float(vrow[r * 32 + lane]);
        }
        m = m_new;
    }

    if (lane == 0) {
        tg_m[sg] = m;
        tg_l[sg] = l;
    }
    #pragma unroll
    for (int r = 0; r < LANE_ELEMS; ++r) {
        tg_acc[sg * D + r * 32 + lane] = acc[r];
    }
    __syncthreads();

    const float m_all = dspark::warp_max(lane < NSIMD ? tg_m[lane] : NEG_BIG);
    float l_all = 0.0f;
    for (int g = 0; g < NSIMD; ++g) {
        l_all += tg_l[g] * __expf(tg_m[g] - m_all);
    }
    const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
    T* orow = out + ((size_t)bh * N + node) * D;
    for (int d = threadIdx.x; d < D; d += NSIMD * 32) {
        float o = 0.0f;
        for (int g = 0; g < NSIMD; ++g) {
            o += tg_acc[g * D + d] * __expf(tg_m[g] - m_all);
        }
        orow[d] = dspark::from_float<T>(o * inv);
    }
"""

CUDA_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
}


def standalone_source(dtype: str, head_dim: int, nsimd: int = NSIMD) -> tuple[str, str]:
    """A self-contained translation unit laid out like the one MLX generates.

    Returns (source, kernel name); the kernel is ``extern "C"`` so nvcc and
    cupy.RawKernel can find it by name. Parameter order matches INPUT_NAMES,
    then OUTPUT_NAMES.
    """
    ctype = CUDA_TYPES[dtype]
    name = f"dspark_tree_attention_{dtype}_{head_dim}_{nsimd}"
    elem = {"bitmask": "uint32_t", "params": "int32_t", "scale": "float"}
    args = [f"    const {elem.get(n, ctype)}* {n}" for n in INPUT_NAMES]
    args += [f"    {ctype}* {n}" for n in OUTPUT_NAMES]
    source = (
        "#ifdef __CUDACC_RTC__\n"  # NVRTC (cupy.RawKernel) has no <cstdint>
        "typedef unsigned int uint32_t;\n"
        "typedef int int32_t;\n"
        "#else\n"
        "#include <cstdint>\n"
        "#endif\n"
        "#include <cooperative_groups.h>\n"
        f"{CUDA_HEADER}\n"
        "namespace cg = cooperative_groups;\n\n"
        f'extern "C" __global__ void {name}(\n' + ",\n".join(args) + ") {\n"
        f"  using T = {ctype};\n"
        f"  constexpr int D = {head_dim};\n"
        f"  constexpr int NSIMD = {nsimd};\n"
        f"{CUDA_SOURCE}\n}}\n"
    )
    return source, name


@lru_cache(maxsize=8)
def _kernel(source: str, name: str):
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name=name,
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        source=source,
        header=CUDA_HEADER,
    )


def tree_attention_cuda(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    bitmask: mx.array,
    scale: float,
    *,
    verbose: bool = False,
) -> mx.array:
    """Run the CUDA twin through mx.fast.cuda_kernel (needs MLX's CUDA back-end)."""
    kernel = _kernel(CUDA_SOURCE, "dspark_tree_attention")
    return kernel(**launch_args(q, k, v, bitmask, scale), verbose=verbose)[0]

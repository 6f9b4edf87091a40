"""Metal tree-attention kernel: one threadgroup per (batch, q-head, query node).

Each simdgroup walks the key axis with stride NSIMD (one key per step, lanes
split the head dim), keeps an online softmax, and the simdgroups are merged
through threadgroup memory at the end. Prefix keys are always visible; node key
j is visible to node i when bit j of row i of the ancestor bitmask is set.
"""

from functools import lru_cache

import mlx.core as mx

from .layout import INPUT_NAMES, OUTPUT_NAMES, launch_args

# MLX prepends its own utilities (metal_stdlib, bfloat16_t) to every custom kernel.
METAL_HEADER = ""

# Template parameters: T (element type), D (head dim, multiple of 32), NSIMD.
# Pointers are `auto`: MLX binds inputs of < 8 elements (params, scale, a small
# bitmask) as `constant`, others as `device`, and the body must accept both.
# params: see layout.kernel_params; L = prefix + N.
METAL_SOURCE = """
    constexpr int LANE_ELEMS = D / 32;
    const float NEG_BIG = -3.0e38f;

    threadgroup float tg_m[NSIMD];
    threadgroup float tg_l[NSIMD];
    threadgroup float tg_acc[NSIMD * D];

    const int HQ = params[1];
    const int HKV = params[2];
    const int N = params[3];
    const int L = params[4];
    const int W = params[5];
    const int P = L - N;

    const int node = threadgroup_position_in_grid.y;
    const int bh = threadgroup_position_in_grid.z;
    const int b = bh / HQ;
    const int kvh = (bh % HQ) / (HQ / HKV);
    const int sg = simdgroup_index_in_threadgroup;
    const int lane = thread_index_in_simdgroup;
    const float sc = scale[0];

    const auto qrow = q + ((size_t)bh * N + node) * D;
    const auto kbase = k + (size_t)(b * HKV + kvh) * L * D;
    const auto vbase = v + (size_t)(b * HKV + kvh) * L * D;
    const auto mrow = bitmask + (size_t)b * params[6] + (size_t)node * W;

    float qv[LANE_ELEMS];
    float acc[LANE_ELEMS];
    for (int r = 0; r < LANE_ELEMS; ++r) {
        qv[r] = sc * float(qrow[r * 32 + lane]);
        acc[r] = 0.0f;
    }
    float m = NEG_BIG;
    float l = 0.0f;

    for (int j = sg; j < L; j += NSIMD) {
        const int t = j - P;
        if (t >= 0 && ((mrow[t >> 5] >> (t & 31)) & 1u) == 0u) {
            continue;
        }
        const auto krow = kbase + (size_t)j * D;
        float s = 0.0f;
        for (int r = 0; r < LANE_ELEMS; ++r) {
            s += qv[r] * float(krow[r * 32 + lane]);
        }
        s = metal::simd_sum(s);
        const float m_new = metal::max(m, s);
        const float corr = metal::fast::exp(m - m_new);
        const float p = metal::fast::exp(s - m_new);
        l = l * corr + p;
        const auto vrow = vbase + (size_t)j * D;
        for (int r = 0; r < LANE_ELEMS; ++r) {
            acc[r] = acc[r] * corr + p * float(vrow[r * 32 + lane]);
        }
        m = m_new;
    }

    if (lane == 0) {
        tg_m[sg] = m;
        tg_l[sg] = l;
    }
    for (int r = 0; r < LANE_ELEMS; ++r) {
        tg_acc[sg * D + r * 32 + lane] = acc[r];
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

    const float m_all = metal::simd_max(lane < NSIMD ? tg_m[lane] : NEG_BIG);
    float l_all = 0.0f;
    for (int g = 0; g < NSIMD; ++g) {
        l_all += tg_l[g] * metal::fast::exp(tg_m[g] - m_all);
    }
    const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
    auto orow = out + ((size_t)bh * N + node) * D;
    for (int d = sg * 32 + lane; d < D; d += NSIMD * 32) {
        float o = 0.0f;
        for (int g = 0; g < NSIMD; ++g) {
            o += tg_acc[g * D + d] * metal::fast::exp(tg_m[g] - m_all);
        }
        orow[d] = static_cast<T>(o * inv);
    }
"""


@lru_cache(maxsize=8)
def _kernel(source: str, name: str):
    return mx.fast.metal_kernel(
        name=name,
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        source=source,
        header=METAL_HEADER,
    )


def tree_attention_metal(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    bitmask: mx.array,
    scale: float,
    *,
    source: str = METAL_SOURCE,
    name: str = "dspark_tree_attention",
    verbose: bool = False,
) -> mx.array:
    kernel = _kernel(source, name)
    return kernel(**launch_args(q, k, v, bitmask, scale), verbose=verbose)[0]

#define KEYS 32
#define KPAD 4  // k_s rows are D + KPAD floats: 16-byte aligned, and a quarter warp's rows on distinct banks
#ifndef INFINITY  // NVRTC includes no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// Raw 16-bit float bits to float32, without cuda_bf16.h / cuda_fp16.h (NVRTC and the CPU shim
// compile the same lines).
__device__ __forceinline__ float bf16_bits_to_float(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

__device__ __forceinline__ float half_bits_to_float(unsigned short x) {
    const unsigned int sign = ((unsigned int)x & 0x8000u) << 16;
    const unsigned int exponent = ((unsigned int)x >> 10) & 0x1fu;
    const unsigned int mantissa = (unsigned int)x & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
    if (exponent == 0u) {  // zero or subnormal: mantissa * 2^-24
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float32 to the 16-bit formats' bits, rounded to nearest even as torch rounds (NaN: torch's
// quiet NaN for bf16, a quiet NaN of the same sign for fp16).
__device__ __forceinline__ unsigned short float_to_bf16_bits(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ unsigned short float_to_half_bits(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 16) & 0x8000u;
    const unsigned int magnitude = u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);              // nan
    if (magnitude >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);             // >= 65520: inf
    if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal step is 2^-24 (1024 steps = the smallest normal)
        return (unsigned short)(sign | (unsigned int)rintf(__uint_as_float(magnitude) * 16777216.0f));
    }
    const unsigned int rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);  // a carry bumps the exponent
    return (unsigned short)(sign | ((rounded - 0x38000000u) >> 13));               // rebias 127 -> 15
}

// 16 bytes, for one vector load or shared-memory access.
struct __align__(16) F4 { float x, y, z, w; };
struct __align__(16) U4 { unsigned int x, y, z, w; };

__device__ __forceinline__ void bf16_pair(unsigned int w, float* out) {  // two bf16 in one word, low first
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ void half_pair(unsigned int w, float* out) {
    out[0] = half_bits_to_float((unsigned short)(w & 0xffffu));
    out[1] = half_bits_to_float((unsigned short)(w >> 16));
}

// A dtype's loads (to float32), its 16-byte loads of VEC elements (p + i 16-byte aligned), and
// its stores (from float32).
struct LoadF32 {
    typedef float T;
    enum { VEC = 4 };
    static __device__ __forceinline__ float at(const float* p, long long i) { return p[i]; }
    static __device__ __forceinline__ void vec_at(const float* p, long long i, float* out) {
        const F4 x = *(const F4*)(p + i);
        out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
    }
    static __device__ __forceinline__ float store(float x) { return x; }
};
struct LoadBF16 {
    typedef unsigned short T;
    enum { VEC = 8 };
    static __device__ __forceinline__ float at(const unsigned short* p, long long i) { return bf16_bits_to_float(p[i]); }
    static __device__ __forceinline__ void vec_at(const unsigned short* p, long long i, float* out) {
        const U4 x = *(const U4*)(p + i);
        bf16_pair(x.x, out); bf16_pair(x.y, out + 2); bf16_pair(x.z, out + 4); bf16_pair(x.w, out + 6);
    }
    static __device__ __forceinline__ unsigned short store(float x) { return float_to_bf16_bits(x); }
};
struct LoadF16 {
    typedef unsigned short T;
    enum { VEC = 8 };
    static __device__ __forceinline__ float at(const unsigned short* p, long long i) { return half_bits_to_float(p[i]); }
    static __device__ __forceinline__ void vec_at(const unsigned short* p, long long i, float* out) {
        const U4 x = *(const U4*)(p + i);
        half_pair(x.x, out); half_pair(x.y, out + 2); half_pair(x.z, out + 4); half_pair(x.w, out + 6);
    }
    static __device__ __forceinline__ unsigned short store(float x) { return float_to_half_bits(x); }
};

// grid (num_splits, row_tiles * KVH, B); any blockDim.x; ROWS query rows a block (a multiple of
// 4); D a multiple of 4. Dynamic shared memory: see tile_smem_bytes. vec: K/V rows start 16-byte
// aligned and D is a multiple of Load::VEC, so tiles load 16 bytes at a time.
template <class Load, int ROWS>
__device__ __forceinline__ void tree_attention_tiles(
    const typename Load::T* __restrict__ q,          // (B, H, T, D) by the strides below
    const typename Load::T* __restrict__ k,          // (B, KVH, C, D) by the strides below
    const typename Load::T* __restrict__ v,          // same strides as k
    const long long* __restrict__ prefix_lengths,    // (B,)
    const unsigned long long* __restrict__ ancestor_bits,  // (B, T)
    typename Load::T* __restrict__ out,              // (B, T, H, D), written when num_splits == 1
    float* __restrict__ partial_acc,                 // (B, H, T, num_splits, D), when num_splits > 1
    float* __restrict__ partial_ml,                  // (B, H, T, num_splits, 2): running max, sum
    const long long q_sb, const long long q_sh, const long long q_st,
    const long long kv_sb, const long long kv_sh, const long long kv_ss,
    const int H, const int KVH, const int T, const int D,
    const int tiles_per_split, const int num_splits, const float scale_log2, const int vec)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned long long* bits_s = (unsigned long long*)smem_raw;  // ROWS: the row's ancestor word
    int* t_s = (int*)(bits_s + ROWS);                            // ROWS: its new token, -1 = padding
    float* q_s = (float*)(t_s + ROWS);                           // ROWS x D, scaled by scale * log2(e)
    float* k_s = q_s + ROWS * D;                                 // KEYS x (D + KPAD)
    float* v_s = k_s + KEYS * (D + KPAD);                        // KEYS x D
    float* p_s = v_s + KEYS * D;                                 // ROWS x KEYS: scores, then weights
    float* acc_s = p_s + ROWS * KEYS;                            // ROWS x D: unnormalised output
    float* m_s = acc_s + ROWS * D;                               // ROWS: running max (log2 units)
    float* l_s = m_s + ROWS;                                     // ROWS: running sum of weights
    float* alpha_s = l_s + ROWS;                                 // ROWS: this tile's rescale

    const int split = blockIdx.x;
    const int kvh = blockIdx.y % KVH;
    const int row0 = (blockIdx.y / KVH) * ROWS;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    const int G = H / KVH;
    const int num_rows = G * T;  // query rows of this KV head: row = t * G + g
    const int L = (int)prefix_lengths[b];
    const int num_keys = L + T;
    const int key_begin = split * tiles_per_split * KEYS;
    const int key_end = min(num_keys, key_begin + tiles_per_split * KEYS);
    const int KD = D + KPAD;

    for (int r = tid; r < ROWS; r += nthreads) {
        const int row = row0 + r;
        t_s[r] = row < num_rows ? row / G : -1;
        bits_s[r] = row < num_rows ? ancestor_bits[(long long)b * T + row / G] : 0ull;
        m_s[r] = -INFINITY;
        l_s[r] = 0.0f;
    }
    for (int i = tid; i < ROWS * D; i += nthreads) {
        const int r = i / D, d = i % D, row = row0 + r;
        float x = 0.0f;
        if (row < num_rows) {
            const int t = row / G, h = kvh * G + row % G;
            x = Load::at(q, (long long)b * q_sb + (long long)h * q_sh + (long long)t * q_st + d) * scale_log2;
        }
        q_s[i] = x;
        acc_s[i] = 0.0f;
    }
    const typename Load::T* k_base = k + (long long)b * kv_sb + (long long)kvh * kv_sh;
    const typename Load::T* v_base = v + (long long)b * kv_sb + (long long)kvh * kv_sh;

    for (int tile = key_begin; tile < key_end; tile += KEYS) {
        __syncthreads();  // the last tile's readers are done (and the setup above is published)
        const int n = min(KEYS, key_end - tile);
        if (vec) {  // 16 bytes of K and of V per item: several loads in flight per thread
            const int pieces = D / Load::VEC;
            for (int i = tid; i < KEYS * pieces; i += nthreads) {
                const int j = i / pieces, d0 = (i % pieces) * Load::VEC;
                float kx[Load::VEC], vx[Load::VEC];
                if (j < n) {
                    const long long at = (long long)(tile + j) * kv_ss + d0;
                    Load::vec_at(k_base, at, kx);
                    Load::vec_at(v_base, at, vx);
                } else {
                    for (int e = 0; e < Load::VEC; ++e) kx[e] = vx[e] = 0.0f;
                }
                for (int e = 0; e < Load::VEC; ++e) {
                    k_s[j * KD + d0 + e] = kx[e];
                    v_s[j * D + d0 + e] = vx[e];
                }
            }
        } else {
            for (int i = tid; i < KEYS * D; i += nthreads) {
                const int j = i / D, d = i % D;
                float kx = 0.0f, vx = 0.0f;
                if (j < n) {
                    const long long at = (long long)(tile + j) * kv_ss + d;
                    kx = Load::at(k_base, at);
                    vx = Load::at(v_base, at);
                }
                k_s[j * KD + d] = kx;
                v_s[j * D + d] = vx;
            }
        }
        __syncthreads();
        // Scores, four rows by one key an item (a warp's keys share its rows' queries).
        // Committed keys are visible to every row, key L + j to token t iff bit j of its word.
        for (int i = tid; i < (ROWS / 4) * KEYS; i += nthreads) {
            const int r0 = (i / KEYS) * 4, j = i % KEYS, key = tile + j;
            const float* kr = k_s + j * KD;
            const float* qr = q_s + r0 * D;
            float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int d = 0; d < D; d += 4) {
                const F4 kk = *(const F4*)(kr + d);
                for (int u = 0; u < 4; ++u) {
                    const F4 qq = *(const F4*)(qr + u * D + d);
                    dot[u] += qq.x * kk.x + qq.y * kk.y + qq.z * kk.z + qq.w * kk.w;
                }
            }
            for (int u = 0; u < 4; ++u) {
                const int r = r0 + u;
                const bool visible = j < n && t_s[r] >= 0 && (key < L || ((bits_s[r] >> (key - L)) & 1ull));
                p_s[r * KEYS + j] = visible ? dot[u] : -INFINITY;
            }
        }
        __syncthreads();
        // Online softmax: each row's new running max and the rescale of what it holds.
        for (int r = tid; r < ROWS; r += nthreads) {
            const float* pr = p_s + r * KEYS;
            float tile_max = -INFINITY;
            for (int j = 0; j < KEYS; ++j) tile_max = fmaxf(tile_max, pr[j]);
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, tile_max);
            m_s[r] = m_new;
            alpha_s[r] = m_new == -INFINITY ? 1.0f : exp2f(m_old - m_new);  // 0 while m_old is -inf
        }
        __syncthreads();
        for (int i = tid; i < ROWS * KEYS; i += nthreads) {  // weights; hidden keys: exp2(-inf) = 0
            const float m = m_s[i / KEYS];
            p_s[i] = m == -INFINITY ? 0.0f : exp2f(p_s[i] - m);  // nothing visible yet: add nothing
        }
        __syncthreads();
        // Weighted values, two rows by four dims an item (each owns its acc_s elements); the
        // item at dims 0..3 also adds its rows' weights to their running sums.
        for (int i = tid; i < (ROWS / 2) * (D / 4); i += nthreads) {
            const int r0 = (i / (D / 4)) * 2, d0 = (i % (D / 4)) * 4;
            const float* w0 = p_s + r0 * KEYS;
            const float* w1 = w0 + KEYS;
            float* a0 = acc_s + r0 * D + d0;
            float* a1 = a0 + D;
            const float alpha0 = alpha_s[r0], alpha1 = alpha_s[r0 + 1];
            float x0 = a0[0] * alpha0, y0 = a0[1] * alpha0, z0 = a0[2] * alpha0, u0 = a0[3] * alpha0;
            float x1 = a1[0] * alpha1, y1 = a1[1] * alpha1, z1 = a1[2] * alpha1, u1 = a1[3] * alpha1;
            float sum0 = 0.0f, sum1 = 0.0f;
            for (int j = 0; j < n; ++j) {
                const F4 vv = *(const F4*)(v_s + j * D + d0);
                const float p0 = w0[j], p1 = w1[j];
                sum0 += p0;
                sum1 += p1;
                x0 += p0 * vv.x; y0 += p0 * vv.y; z0 += p0 * vv.z; u0 += p0 * vv.w;
                x1 += p1 * vv.x; y1 += p1 * vv.y; z1 += p1 * vv.z; u1 += p1 * vv.w;
            }
            a0[0] = x0; a0[1] = y0; a0[2] = z0; a0[3] = u0;
            a1[0] = x1; a1[1] = y1; a1[2] = z1; a1[3] = u1;
            if (d0 == 0) {
                l_s[r0] = l_s[r0] * alpha0 + sum0;
                l_s[r0 + 1] = l_s[r0 + 1] * alpha1 + sum1;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < ROWS * D; i += nthreads) {
        const int r = i / D, d = i % D, row = row0 + r;
        if (row >= num_rows) continue;
        const int t = row / G, h = kvh * G + row % G;
        if (num_splits == 1) {
            out[(((long long)b * T + t) * H + h) * D + d] = Load::store(acc_s[i] / l_s[r]);
        } else {
            const long long state = (((long long)b * H + h) * T + t) * num_splits + split;
            partial_acc[state * D + d] = acc_s[i];
            if (d == 0) {
                partial_ml[state * 2] = m_s[r];
                partial_ml[state * 2 + 1] = l_s[r];
            }
        }
    }
}

#define TREE_ATTENTION_ENTRY(NAME, LOAD, ROWS)                                                    \
extern "C" __global__ void NAME(                                                                  \
    const LOAD::T* q, const LOAD::T* k, const LOAD::T* v, const long long* prefix_lengths,        \
    const unsigned long long* ancestor_bits, LOAD::T* out, float* partial_acc, float* partial_ml, \
    long long q_sb, long long q_sh, long long q_st, long long kv_sb, long long kv_sh, long long kv_ss, \
    int H, int KVH, int T, int D, int tiles_per_split, int num_splits, float scale_log2, int vec) { \
    tree_attention_tiles<LOAD, ROWS>(q, k, v, prefix_lengths, ancestor_bits, out, partial_acc,    \
        partial_ml, q_sb, q_sh, q_st, kv_sb, kv_sh, kv_ss, H, KVH, T, D, tiles_per_split,         \
        num_splits, scale_log2, vec);                                                             \
}

TREE_ATTENTION_ENTRY(tree_attention_f32_r16, LoadF32, 16)
TREE_ATTENTION_ENTRY(tree_attention_bf16_r16, LoadBF16, 16)
TREE_ATTENTION_ENTRY(tree_attention_f16_r16, LoadF16, 16)
TREE_ATTENTION_ENTRY(tree_attention_f32_r32, LoadF32, 32)
TREE_ATTENTION_ENTRY(tree_attention_bf16_r32, LoadBF16, 32)
TREE_ATTENTION_ENTRY(tree_attention_f16_r32, LoadF16, 32)

// Merge the splits' states: one thread per output element (b, t, h, d), any grid.
template <class Load>
__device__ __forceinline__ void combine_splits(
    const float* __restrict__ partial_acc,  // (B, H, T, num_splits, D)
    const float* __restrict__ partial_ml,   // (B, H, T, num_splits, 2)
    typename Load::T* __restrict__ out,     // (B, T, H, D)
    const int H, const int T, const int D, const int num_splits, const long long total)
{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(i % D);
        const long long state0 = (i / D) * num_splits;  // (b, h, t) row of the states
        const int t = (int)((i / D) % T);
        const long long bh = i / D / T;
        const int h = (int)(bh % H);
        const long long b = bh / H;
        float m = -INFINITY;
        for (int s = 0; s < num_splits; ++s) m = fmaxf(m, partial_ml[(state0 + s) * 2]);
        float numerator = 0.0f, denominator = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float w = exp2f(partial_ml[(state0 + s) * 2] - m);  // an empty split: exp2(-inf) = 0
            numerator += w * partial_acc[(state0 + s) * D + d];
            denominator += w * partial_ml[(state0 + s) * 2 + 1];
        }
        out[((b * T + t) * H + h) * D + d] = Load::store(numerator / denominator);
    }
}

#define COMBINE_ENTRY(NAME, LOAD)                                                                 \
extern "C" __global__ void NAME(const float* partial_acc, const float* partial_ml, LOAD::T* out, \
                                int H, int T, int D, int num_splits, long long total) {           \
    combine_splits<LOAD>(partial_acc, partial_ml, out, H, T, D, num_splits, total);              \
}

COMBINE_ENTRY(tree_attention_combine_f32, LoadF32)
COMBINE_ENTRY(tree_attention_combine_bf16, LoadBF16)
COMBINE_ENTRY(tree_attention_combine_f16, LoadF16)

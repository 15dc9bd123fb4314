// Engram's CUDA kernels, compiled at run time by NVRTC (see compile.rs) for the device's own
// architecture. Activations are f32, row-major [rows][width]; weights stay in their GGML block
// format in device memory and are dequantised on the fly (GEMV) or into f16 tiles for cuBLAS
// (prefill). The KV cache is f16, [kv_head][capacity][head_dim] per layer, as on the CPU.

// No headers: NVRTC's builtins are enough, so the appliance needs only libnvrtc (no toolkit
// headers). f16 values are u16 bit patterns converted by the PTX cvt instructions.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// GGML type ids (ggml.h), the template argument of the dequantisers.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14

// Most activation rows one GEMV launch multiplies at once (decode batches); more go to cuBLAS.
#define MAX_BATCH 8

__device__ __forceinline__ float f16_at(const u8* p) {
    return h2f(*(const u16*)p);
}

__device__ __forceinline__ u32 u32_at(const u8* p) {
    // Blocks are only 2-byte aligned (18-, 20-, 22-byte blocks): two 16-bit loads.
    return (u32)(*(const u16*)p) | ((u32)(*(const u16*)(p + 2)) << 16);
}

// Bytes of one block and values per block of each type.
template <int T> struct Traits;
template <> struct Traits<T_F32> { static const int bytes = 128; static const int qk = 32; };
template <> struct Traits<T_F16> { static const int bytes = 64; static const int qk = 32; };
template <> struct Traits<T_Q4_0> { static const int bytes = 18; static const int qk = 32; };
template <> struct Traits<T_Q4_1> { static const int bytes = 20; static const int qk = 32; };
template <> struct Traits<T_Q5_0> { static const int bytes = 22; static const int qk = 32; };
template <> struct Traits<T_Q5_1> { static const int bytes = 24; static const int qk = 32; };
template <> struct Traits<T_Q8_0> { static const int bytes = 34; static const int qk = 32; };
template <> struct Traits<T_Q4_K> { static const int bytes = 144; static const int qk = 256; };
template <> struct Traits<T_Q5_K> { static const int bytes = 176; static const int qk = 256; };
template <> struct Traits<T_Q6_K> { static const int bytes = 210; static const int qk = 256; };

// ggml's get_scale_min_k4: the six-bit scale and min of group j (0..8) of a Q4_K/Q5_K block.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// Dequantises the 32 values of group `g` (values 32g..32g+32) of a row into `out`.
template <int T> __device__ __forceinline__ void dequant32(const u8* row, int g, float* out);

template <> __device__ __forceinline__ void dequant32<T_F32>(const u8* row, int g, float* out) {
    const float4* p = (const float4*)(row + g * 128);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = p[i];
        out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
}

template <> __device__ __forceinline__ void dequant32<T_F16>(const u8* row, int g, float* out) {
    const u32* p = (const u32*)(row + g * 64);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u32 v = p[i];
        out[2 * i] = h2f((u16)(v & 0xFFFF));
        out[2 * i + 1] = h2f((u16)(v >> 16));
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q4_0>(const u8* row, int g, float* out) {
    const u8* b = row + g * 18;
    float d = f16_at(b);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = u32_at(b + 2 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 byte = (q >> (8 * k)) & 0xFF;
            out[4 * i + k] = d * ((float)(byte & 0xF) - 8.0f);
            out[16 + 4 * i + k] = d * ((float)(byte >> 4) - 8.0f);
        }
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q4_1>(const u8* row, int g, float* out) {
    const u8* b = row + g * 20;
    float d = f16_at(b), m = f16_at(b + 2);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = *(const u32*)(b + 4 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 byte = (q >> (8 * k)) & 0xFF;
            out[4 * i + k] = d * (float)(byte & 0xF) + m;
            out[16 + 4 * i + k] = d * (float)(byte >> 4) + m;
        }
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q5_0>(const u8* row, int g, float* out) {
    const u8* b = row + g * 22;
    float d = f16_at(b);
    u32 qh = u32_at(b + 2);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = u32_at(b + 6 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int j = 4 * i + k;
            u32 byte = (q >> (8 * k)) & 0xFF;
            u32 lo = (byte & 0xF) | (((qh >> j) & 1) << 4);
            u32 hi = (byte >> 4) | (((qh >> (j + 16)) & 1) << 4);
            out[j] = d * ((float)lo - 16.0f);
            out[16 + j] = d * ((float)hi - 16.0f);
        }
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q5_1>(const u8* row, int g, float* out) {
    const u8* b = row + g * 24;
    float d = f16_at(b), m = f16_at(b + 2);
    u32 qh = *(const u32*)(b + 4);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = *(const u32*)(b + 8 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int j = 4 * i + k;
            u32 byte = (q >> (8 * k)) & 0xFF;
            u32 lo = (byte & 0xF) | (((qh >> j) & 1) << 4);
            u32 hi = (byte >> 4) | (((qh >> (j + 16)) & 1) << 4);
            out[j] = d * (float)lo + m;
            out[16 + j] = d * (float)hi + m;
        }
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q8_0>(const u8* row, int g, float* out) {
    const u8* b = row + g * 34;
    float d = f16_at(b);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 q = u32_at(b + 2 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            out[4 * i + k] = d * (float)(signed char)((q >> (8 * k)) & 0xFF);
        }
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q4_K>(const u8* row, int g, float* out) {
    const u8* b = row + (g >> 3) * 144;
    int j = g & 7;
    float d = f16_at(b), dmin = f16_at(b + 2), sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    float a = d * sc, c = dmin * m;
    const u8* qs = b + 16 + 32 * (j >> 1);
    int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 q = *(const u32*)(qs + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            out[4 * i + k] = a * (float)((q >> (8 * k + shift)) & 0xF) - c;
        }
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q5_K>(const u8* row, int g, float* out) {
    const u8* b = row + (g >> 3) * 176;
    int j = g & 7;
    float d = f16_at(b), dmin = f16_at(b + 2), sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    float a = d * sc, c = dmin * m;
    const u8* qh = b + 16;
    const u8* ql = b + 48 + 32 * (j >> 1);
    int shift = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        u32 q = ((ql[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4);
        out[l] = a * (float)q - c;
    }
}

template <> __device__ __forceinline__ void dequant32<T_Q6_K>(const u8* row, int g, float* out) {
    const u8* b = row + (g >> 3) * 210;
    int j = g & 7, half_ = j >> 2, quarter = j & 3;
    const u8* ql = b + 64 * half_ + ((quarter & 1) ? 32 : 0);
    const u8* qh = b + 128 + 32 * half_;
    const signed char* sc = (const signed char*)(b + 192 + 8 * half_ + 2 * quarter);
    float d = f16_at(b + 208);
    int lshift = (quarter >> 1) * 4, hshift = quarter * 2;
    float s0 = d * (float)sc[0], s1 = d * (float)sc[1];
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = (int)(((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        out[l] = (l < 16 ? s0 : s1) * (float)q;
    }
}

// y[j][r] = sum_c W[r][c] * x[j][c] for j < n <= MAX_BATCH: one warp per output row, each lane
// dequantising whole 32-value groups once for all n activation rows.
template <int T>
__device__ void gemv(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                     int rows, int cols, int n) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int row_bytes = cols / Traits<T>::qk * Traits<T>::bytes;
    const u8* wr = w + (size_t)row * row_bytes;
    float acc[MAX_BATCH];
#pragma unroll
    for (int j = 0; j < MAX_BATCH; j++) acc[j] = 0.0f;
    int groups = cols / 32;
    for (int g = lane; g < groups; g += 32) {
        float v[32];
        dequant32<T>(wr, g, v);
#pragma unroll
        for (int j = 0; j < MAX_BATCH; j++) {
            if (j < n) {
                const float4* xp = (const float4*)(x + (size_t)j * cols + g * 32);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float4 xv = __ldg(xp + i);
                    s += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
                }
                acc[j] += s;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MAX_BATCH; j++) {
        if (j < n) {
            float s = acc[j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            if (lane == 0) y[(size_t)j * rows + row] = s;
        }
    }
}

// ---- Decode GEMV on int8 activations (llama.cpp's approach: activations quantised to Q8_1,
// weights unpacked to int8 lanes, four products per __dp4a). Each weight group of 32 values
// unpacks to 8 ints of packed int8 `q` and scales so that its dot with an activation group
// (int8 `x`, scale dx, sx = dx * sum(x)) is dx * (a * dot(q[0..4], x[0..4]) +
// a2 * dot(q[4..8], x[4..8])) + b * sx.
struct W32 {
    int q[8];
    float a, a2, b;
};

// Spreads the low 4 bits of h to bit 4 of each of 4 bytes.
__device__ __forceinline__ u32 spread4(u32 h) {
    return ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25);
}

template <int T> __device__ __forceinline__ void unpack32(const u8* row, int g, W32& w);

template <> __device__ __forceinline__ void unpack32<T_Q4_0>(const u8* row, int g, W32& w) {
    const u8* b = row + g * 18;
    float d = f16_at(b);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = u32_at(b + 2 + 4 * i);
        w.q[i] = q & 0x0F0F0F0F;
        w.q[4 + i] = (q >> 4) & 0x0F0F0F0F;
    }
    w.a = d; w.a2 = d; w.b = -8.0f * d;
}

template <> __device__ __forceinline__ void unpack32<T_Q4_1>(const u8* row, int g, W32& w) {
    const u8* b = row + g * 20;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = *(const u32*)(b + 4 + 4 * i);
        w.q[i] = q & 0x0F0F0F0F;
        w.q[4 + i] = (q >> 4) & 0x0F0F0F0F;
    }
    w.a = f16_at(b); w.a2 = w.a; w.b = f16_at(b + 2);
}

template <> __device__ __forceinline__ void unpack32<T_Q5_0>(const u8* row, int g, W32& w) {
    const u8* b = row + g * 22;
    float d = f16_at(b);
    u32 qh = u32_at(b + 2);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = u32_at(b + 6 + 4 * i);
        w.q[i] = (q & 0x0F0F0F0F) | spread4((qh >> (4 * i)) & 0xF);
        w.q[4 + i] = ((q >> 4) & 0x0F0F0F0F) | spread4((qh >> (16 + 4 * i)) & 0xF);
    }
    w.a = d; w.a2 = d; w.b = -16.0f * d;
}

template <> __device__ __forceinline__ void unpack32<T_Q5_1>(const u8* row, int g, W32& w) {
    const u8* b = row + g * 24;
    u32 qh = *(const u32*)(b + 4);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = *(const u32*)(b + 8 + 4 * i);
        w.q[i] = (q & 0x0F0F0F0F) | spread4((qh >> (4 * i)) & 0xF);
        w.q[4 + i] = ((q >> 4) & 0x0F0F0F0F) | spread4((qh >> (16 + 4 * i)) & 0xF);
    }
    w.a = f16_at(b); w.a2 = w.a; w.b = f16_at(b + 2);
}

template <> __device__ __forceinline__ void unpack32<T_Q8_0>(const u8* row, int g, W32& w) {
    const u8* b = row + g * 34;
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = (int)u32_at(b + 2 + 4 * i);
    w.a = f16_at(b); w.a2 = w.a; w.b = 0.0f;
}

template <> __device__ __forceinline__ void unpack32<T_Q4_K>(const u8* row, int g, W32& w) {
    const u8* b = row + (g >> 3) * 144;
    int j = g & 7;
    float sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    const u8* qs = b + 16 + 32 * (j >> 1);
    int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = (*(const u32*)(qs + 4 * i) >> shift) & 0x0F0F0F0F;
    w.a = f16_at(b) * sc; w.a2 = w.a; w.b = -f16_at(b + 2) * m;
}

template <> __device__ __forceinline__ void unpack32<T_Q5_K>(const u8* row, int g, W32& w) {
    const u8* b = row + (g >> 3) * 176;
    int j = g & 7;
    float sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    const u8* qh = b + 16;
    const u8* ql = b + 48 + 32 * (j >> 1);
    int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 lo = (*(const u32*)(ql + 4 * i) >> shift) & 0x0F0F0F0F;
        u32 hi = ((*(const u32*)(qh + 4 * i) >> j) & 0x01010101) << 4;
        w.q[i] = lo | hi;
    }
    w.a = f16_at(b) * sc; w.a2 = w.a; w.b = -f16_at(b + 2) * m;
}

template <> __device__ __forceinline__ void unpack32<T_Q6_K>(const u8* row, int g, W32& w) {
    const u8* b = row + (g >> 3) * 210;
    int j = g & 7, half_ = j >> 2, quarter = j & 3;
    const u8* ql = b + 64 * half_ + ((quarter & 1) ? 32 : 0);
    const u8* qh = b + 128 + 32 * half_;
    const signed char* sc = (const signed char*)(b + 192 + 8 * half_ + 2 * quarter);
    int lshift = (quarter >> 1) * 4, hshift = quarter * 2;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 lo = (u32_at(ql + 4 * i) >> lshift) & 0x0F0F0F0F;
        u32 hi = ((u32_at(qh + 4 * i) >> hshift) & 0x03030303) << 4;
        w.q[i] = (int)__vsub4(lo | hi, 0x20202020);
    }
    float d = f16_at(b + 208);
    w.a = d * (float)sc[0]; w.a2 = d * (float)sc[1]; w.b = 0.0f;
}

// Quantises the 32-value group the calling warp holds, one value per lane, to Q8_1 (the rule
// below): element i of the activation rows (a multiple of 32 at lane 0) goes to xq[i] and its
// group's (d, d * sum) to xds[i / 32] where `write`. Every lane of the warp must call it.
__device__ __forceinline__ void q8_group(float v, size_t i, bool write, signed char* xq,
                                         float2* xds) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    float d = amax / 127.0f;
    int q = amax == 0.0f ? 0 : (int)roundf(v / d);
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (write) {
        xq[i] = (signed char)q;
        if ((threadIdx.x & 31) == 0) xds[i / 32] = make_float2(d, d * (float)sum);
    }
}

// Activations to Q8_1 groups of 32 (ggml's quantize_row_q8_1: d = amax / 127, q = round(x / d),
// and d * sum(q)): one warp per group; xq [rows][cols] int8, xds [rows][cols / 32] (d, d * sum).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, signed char* __restrict__ xq,
                                         float2* __restrict__ xds, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    q8_group(i < n ? x[i] : 0.0f, i, i < n, xq, xds);
}

// Rows per block of the Q8_1 GEMVs, and the warps splitting each row's groups (the default
// shape; GEMV_Q8_SHAPE below instantiates others for benchmarks).
#define ROWS_PER_WARP 2
#define GEMV_WARPS 4

// y[j][r] = W[r] . x[j] for the N activation rows: each block takes R rows, its W warps split
// their groups, and each lane takes whole 32-value groups, so every weight group is unpacked
// once for the N activation rows and every activation group loaded once for the block's rows.
template <int T, int N, int R, int W>
__device__ void gemv_q8(int block, const u8* __restrict__ w, float* __restrict__ y, int rows,
                        const signed char* __restrict__ xq, const float2* __restrict__ xds,
                        int cols) {
    __shared__ float partial[W][R][N];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int row0 = block * R;
    if (row0 >= rows) return;  // uniform across the block
    const int groups = cols / 32;
    const size_t row_bytes = (size_t)(cols / Traits<T>::qk) * Traits<T>::bytes;
    float acc[R][N];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < N; j++) acc[r][j] = 0.0f;
    // The block's warps split the row's groups: every lane's loads are in flight at once.
    for (int g = warp * 32 + lane; g < groups; g += 32 * W) {
        int xv[N][8];
        float2 ds[N];
#pragma unroll
        for (int j = 0; j < N; j++) {
            const int4* xp = (const int4*)(xq + (size_t)j * cols + (size_t)g * 32);
            int4 lo = __ldg(xp), hi = __ldg(xp + 1);
            xv[j][0] = lo.x; xv[j][1] = lo.y; xv[j][2] = lo.z; xv[j][3] = lo.w;
            xv[j][4] = hi.x; xv[j][5] = hi.y; xv[j][6] = hi.z; xv[j][7] = hi.w;
            ds[j] = __ldg(xds + (size_t)j * groups + g);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row0 + r < rows) {
                W32 wq;
                unpack32<T>(w + (size_t)(row0 + r) * row_bytes, g, wq);
#pragma unroll
                for (int j = 0; j < N; j++) {
                    int s0 = 0, s1 = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        s0 = __dp4a(wq.q[i], xv[j][i], s0);
                        s1 = __dp4a(wq.q[4 + i], xv[j][4 + i], s1);
                    }
                    acc[r][j] += ds[j].x * (wq.a * (float)s0 + wq.a2 * (float)s1) + wq.b * ds[j].y;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int j = 0; j < N; j++) {
            float s = acc[r][j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            if (lane == 0) partial[warp][r][j] = s;
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < R * N; k += 32 * W) {
        int r = k / N, j = k % N;
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < W; q++) s += partial[q][r][j];
        if (row0 + r < rows) y[(size_t)j * rows + row0 + r] = s;
    }
}

// Up to three matrices of one type sharing the input (Q, K and V; gate and up) in one launch:
// the first row blocks are matrix 0's, the next matrix 1's, the rest matrix 2's (rows 0 when
// absent). A grid smaller than the row blocks walks them in strides (a persistent grid).
template <int T, int N, int R, int W>
__device__ void gemv_q8_multi(const u8* w0, float* y0, int rows0, const u8* w1, float* y1,
                              int rows1, const u8* w2, float* y2, int rows2,
                              const signed char* xq, const float2* xds, int cols) {
    const int b0 = (rows0 + R - 1) / R, b1 = (rows1 + R - 1) / R, b2 = (rows2 + R - 1) / R;
    for (int block = blockIdx.x; block < b0 + b1 + b2; block += gridDim.x) {
        if (block < b0) {
            gemv_q8<T, N, R, W>(block, w0, y0, rows0, xq, xds, cols);
        } else if (block < b0 + b1) {
            gemv_q8<T, N, R, W>(block - b0, w1, y1, rows1, xq, xds, cols);
        } else {
            gemv_q8<T, N, R, W>(block - b0 - b1, w2, y2, rows2, xq, xds, cols);
        }
        __syncthreads();  // the partials are reused by the next row block
    }
}

#define GEMV_Q8_SHAPE(name, T, N, R, W, tag)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * W) gemv_q8_##name##_##N##tag(               \
        const u8* w0, float* y0, int rows0, const u8* w1, float* y1, int rows1, const u8* w2,     \
        float* y2, int rows2, const signed char* xq, const float2* xds, int cols) {               \
        gemv_q8_multi<T, N, R, W>(w0, y0, rows0, w1, y1, rows1, w2, y2, rows2, xq, xds, cols);    \
    }
#define GEMV_Q8(name, T, N) GEMV_Q8_SHAPE(name, T, N, ROWS_PER_WARP, GEMV_WARPS, )
#define GEMV_Q8_ALL(name, T)                                                                       \
    GEMV_Q8(name, T, 1) GEMV_Q8(name, T, 2) GEMV_Q8(name, T, 3) GEMV_Q8(name, T, 4)               \
    GEMV_Q8(name, T, 5) GEMV_Q8(name, T, 6) GEMV_Q8(name, T, 7) GEMV_Q8(name, T, 8)
// Other block shapes (R rows, W warps) of the most common types at one and eight activation
// rows, named gemv_q8_{type}_{n}_r{R}w{W}: `engram gpu bench --gemv` measures them.
#define GEMV_Q8_SHAPES(name, T)                                                                    \
    GEMV_Q8_SHAPE(name, T, 1, 1, 4, _r1w4) GEMV_Q8_SHAPE(name, T, 8, 1, 4, _r1w4)                \
    GEMV_Q8_SHAPE(name, T, 1, 4, 4, _r4w4) GEMV_Q8_SHAPE(name, T, 8, 4, 4, _r4w4)                \
    GEMV_Q8_SHAPE(name, T, 1, 2, 8, _r2w8) GEMV_Q8_SHAPE(name, T, 8, 2, 8, _r2w8)                \
    GEMV_Q8_SHAPE(name, T, 1, 8, 2, _r8w2) GEMV_Q8_SHAPE(name, T, 8, 8, 2, _r8w2)

GEMV_Q8_ALL(q4_0, T_Q4_0)
GEMV_Q8_ALL(q4_1, T_Q4_1)
GEMV_Q8_ALL(q5_0, T_Q5_0)
GEMV_Q8_ALL(q5_1, T_Q5_1)
GEMV_Q8_ALL(q8_0, T_Q8_0)
GEMV_Q8_ALL(q4_k, T_Q4_K)
GEMV_Q8_ALL(q5_k, T_Q5_K)
GEMV_Q8_ALL(q6_k, T_Q6_K)
GEMV_Q8_SHAPES(q4_0, T_Q4_0)
GEMV_Q8_SHAPES(q4_k, T_Q4_K)

// out[r][c] = W[r][c] as f16 (cuBLAS prefill); one thread per 32-value group.
template <int T>
__device__ void dequant_f16(const u8* __restrict__ w, u16* __restrict__ out, int rows, int cols) {
    size_t groups = (size_t)cols / 32;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * groups) return;
    size_t r = i / groups;
    int g = (int)(i % groups);
    const int row_bytes = cols / Traits<T>::qk * Traits<T>::bytes;
    float v[32];
    dequant32<T>(w + r * row_bytes, g, v);
    u32* o = (u32*)(out + r * cols + (size_t)g * 32);
#pragma unroll
    for (int k = 0; k < 16; k++) o[k] = (u32)f2h(v[2 * k]) | ((u32)f2h(v[2 * k + 1]) << 16);
}

#define INSTANTIATE(name, T)                                                                       \
    extern "C" __global__ void gemv_##name(const u8* w, const float* x, float* y, int rows,      \
                                           int cols, int n) {                                     \
        gemv<T>(w, x, y, rows, cols, n);                                                           \
    }                                                                                              \
    extern "C" __global__ void dequant_f16_##name(const u8* w, u16* out, int rows, int cols) {    \
        dequant_f16<T>(w, out, rows, cols);                                                        \
    }

INSTANTIATE(f32, T_F32)
INSTANTIATE(f16, T_F16)
INSTANTIATE(q4_0, T_Q4_0)
INSTANTIATE(q4_1, T_Q4_1)
INSTANTIATE(q5_0, T_Q5_0)
INSTANTIATE(q5_1, T_Q5_1)
INSTANTIATE(q8_0, T_Q8_0)
INSTANTIATE(q4_k, T_Q4_K)
INSTANTIATE(q5_k, T_Q5_K)
INSTANTIATE(q6_k, T_Q6_K)

extern "C" __global__ void f32_to_f16(const float* in, u16* out, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(in[i]);
}

__device__ __forceinline__ float block_sum(float v, float* shared) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < warps; i++) s += shared[i];
    return s;
}

// out[r] = x[r] / rms(x[r]) * w, one block per row of `width` values (in place when out == x).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int width, float eps) {
    __shared__ float shared[32];
    const float* xr = x + (size_t)blockIdx.x * width;
    float* o = out + (size_t)blockIdx.x * width;
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s, shared);
    float scale = rsqrtf(s / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}


// rms_norm, also writing the normalised rows as Q8_1 for the decode GEMVs that follow (width a
// multiple of 32 and of nothing else: a warp's lanes always hold one whole group). With y, first
// x += y (the residual add before the norm), written back to x.
__device__ __forceinline__ void norm_q8_row(float* x, const float* y, const float* w, float* out,
                                            int width, float eps, signed char* xq, float2* xds) {
    __shared__ float shared[32];
    float* xr = x + (size_t)blockIdx.x * width;
    float* o = out + (size_t)blockIdx.x * width;
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i];
        if (y != 0) {
            v += y[(size_t)blockIdx.x * width + i];
            xr[i] = v;
        }
        s += v * v;
    }
    s = block_sum(s, shared);
    float scale = rsqrtf(s / (float)width + eps);
    const int rounds = (width + blockDim.x - 1) / blockDim.x;
    for (int k = 0; k < rounds; k++) {
        int i = k * blockDim.x + threadIdx.x;
        bool in = i < width;
        float v = in ? xr[i] * scale * w[i] : 0.0f;
        if (in) o[i] = v;
        q8_group(v, (size_t)blockIdx.x * width + i, in, xq, xds);
    }
}

extern "C" __global__ void rms_norm_q8(float* x, const float* w, float* out, int width, float eps,
                                       signed char* xq, float2* xds) {
    norm_q8_row(x, 0, w, out, width, eps, xq, xds);
}

extern "C" __global__ void add_rms_norm_q8(float* x, const float* y, const float* w, float* out,
                                           int width, float eps, signed char* xq, float2* xds) {
    norm_q8_row(x, y, w, out, width, eps, xq, xds);
}

// gate = silu(gate) * up, also written as Q8_1 (n a multiple of 32).
extern "C" __global__ void swiglu_q8(float* gate, const float* up, size_t n, signed char* xq,
                                     float2* xds) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    bool in = i < n;
    float v = 0.0f;
    if (in) {
        float g = gate[i];
        v = g / (1.0f + expf(-g)) * up[i];
        gate[i] = v;
    }
    q8_group(v, i, in, xq, xds);
}

// x[r][c] += b[c] for rows of `width`.
extern "C" __global__ void add_bias(float* x, const float* b, int width, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % width];
}

// x += y.
extern "C" __global__ void add(float* x, const float* y, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// gate = silu(gate) * up.
extern "C" __global__ void swiglu(float* gate, const float* up, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// Rotates every head of row t of x ([rows][heads * head_dim]) by the row's (cos, sin) pairs
// (angles: [rows][pairs], computed on the host exactly as the CPU path computes them, so every
// scaling variant is the CPU's own). neox: pairs (i, i + pairs), else (2i, 2i + 1).
__device__ __forceinline__ void rope_row(float* x, const float2* angles, int t, int heads,
                                         int head_dim, int pairs, int neox) {
    for (int k = threadIdx.x; k < heads * pairs; k += blockDim.x) {
        int h = k / pairs, i = k % pairs;
        float2 cs = angles[(size_t)t * pairs + i];
        float* hp = x + ((size_t)t * heads + h) * head_dim;
        int a = neox ? i : 2 * i, b = neox ? i + pairs : 2 * i + 1;
        float x0 = hp[a], x1 = hp[b];
        hp[a] = x0 * cs.x - x1 * cs.y;
        hp[b] = x0 * cs.y + x1 * cs.x;
    }
}

extern "C" __global__ void rope(float* x, const float2* angles, int heads, int head_dim, int pairs,
                                int neox) {
    rope_row(x, angles, blockIdx.x, heads, head_dim, pairs, neox);
}

// rope of the queries (q: [rows][n_head * head_dim]) and keys (k: [rows][n_kv * head_dim]) in
// one launch: blockIdx.y 0 rotates q, 1 rotates k.
extern "C" __global__ void rope_qk(float* q, float* k, const float2* angles, int n_head, int n_kv,
                                   int head_dim, int pairs, int neox) {
    if (blockIdx.y == 0) {
        rope_row(q, angles, blockIdx.x, n_head, head_dim, pairs, neox);
    } else {
        rope_row(k, angles, blockIdx.x, n_kv, head_dim, pairs, neox);
    }
}

// Writes row t's keys and values ([rows][kv_heads * head_dim], f32) into cache slot slots[t]
// of one layer's caches ([kv_heads][capacity][head_dim], f16).
__device__ __forceinline__ void kv_store_row(const float* k, const float* v, u16* kc, u16* vc,
                                             int t, size_t slot, int kv_heads, int head_dim,
                                             int capacity) {
    int width = kv_heads * head_dim;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        int h = i / head_dim, d = i % head_dim;
        size_t dst = ((size_t)h * capacity + slot) * head_dim + d;
        kc[dst] = f2h(k[(size_t)t * width + i]);
        vc[dst] = f2h(v[(size_t)t * width + i]);
    }
}

extern "C" __global__ void kv_store(const float* k, const float* v, u16* kc, u16* vc,
                                    const int* slots, int kv_heads, int head_dim, int capacity) {
    int t = blockIdx.x;
    kv_store_row(k, v, kc, vc, t, (size_t)slots[t], kv_heads, head_dim, capacity);
}

// Stored chunk KV into the cache: stage_k/stage_v hold `len` slots of every layer and KV head
// ([layer][kv_head][len][head_dim], f16, keys after RoPE at their stored positions); they go to
// slots first_slot.. of every layer's cache, the keys rotated on by the shift's (cos, sin) per
// pair (`shift`: [pairs]) as Rope::shift does on the CPU. One thread per value.
extern "C" __global__ void kv_import(const u16* stage_k, const u16* stage_v, u16* kc, u16* vc,
                                     int first_slot, int len, int n_layer, int kv_heads,
                                     int head_dim, int capacity, const float2* shift, int pairs,
                                     int neox) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t total = (size_t)n_layer * kv_heads * len * head_dim;
    if (i >= total) return;
    int d = i % head_dim;
    size_t row = i / head_dim;  // (layer * kv_heads + head) * len + t
    int t = row % len;
    size_t lh = row / len;
    const u16* kr = stage_k + row * head_dim;
    float out;
    if (neox) {
        if (d < pairs) {
            float2 cs = shift[d];
            out = h2f(kr[d]) * cs.x - h2f(kr[d + pairs]) * cs.y;
        } else if (d < 2 * pairs) {
            float2 cs = shift[d - pairs];
            out = h2f(kr[d - pairs]) * cs.y + h2f(kr[d]) * cs.x;
        } else {
            out = h2f(kr[d]);
        }
    } else if (d < 2 * pairs) {
        float2 cs = shift[d / 2];
        out = (d & 1) ? h2f(kr[d - 1]) * cs.y + h2f(kr[d]) * cs.x
                      : h2f(kr[d]) * cs.x - h2f(kr[d + 1]) * cs.y;
    } else {
        out = h2f(kr[d]);
    }
    size_t dst = (lh * capacity + first_slot + t) * head_dim + d;
    kc[dst] = f2h(out);
    vc[dst] = stage_v[i];
}

// Attention of queries q ([n_q][n_head * head_dim]) at positions q_pos over the first kv_len
// slots of one layer's cache (slot j visible to query i when kv_pos[j] <= q_pos[i]), split over
// gridDim.z ranges of the slots: each (query tile, head, split) block writes its running max,
// sum and unnormalised output to the partials, attention_combine merges them. One warp per
// query; the block's warps share each tile of KEY_TILE keys and values in shared memory (f32,
// rows padded by four floats: 16-byte aligned for vector reads, and lane j reading key j's row
// in quarter-warps of distinct banks).
#define KEY_TILE 32
extern "C" __global__ void attention(const float* __restrict__ q, const u16* __restrict__ kc,
                                     const u16* __restrict__ vc, const int* __restrict__ kv_pos,
                                     const int* __restrict__ q_pos, float* __restrict__ part_o,
                                     float* __restrict__ part_ml, int n_q, int n_head, int kv_heads,
                                     int head_dim, int capacity, int kv_len, float scale,
                                     int tiles_per_split) {
    extern __shared__ float4 smem4[];
    float* smem = (float*)smem4;
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int stride = head_dim + 4;
    float* ks = smem;
    float* vs = ks + KEY_TILE * stride;
    float* qs = vs + KEY_TILE * stride;  // [warps][head_dim]
    const int h = blockIdx.y, kvh = h / (n_head / kv_heads), split = blockIdx.z;
    const int qi = blockIdx.x * warps + warp;
    const bool active = qi < n_q;
    const int my_pos = active ? q_pos[qi] : -1;
    for (int d = lane; d < head_dim; d += 32)
        qs[warp * head_dim + d] = active ? q[((size_t)qi * n_head + h) * head_dim + d] * scale : 0.0f;
    const int per_lane = head_dim / 32;  // head_dim is a multiple of 32 (checked on the host)
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    const u16* kbase = kc + (size_t)kvh * capacity * head_dim;
    const u16* vbase = vc + (size_t)kvh * capacity * head_dim;
    int tile_begin = split * tiles_per_split;
    int tile_end = min(tile_begin + tiles_per_split, (kv_len + KEY_TILE - 1) / KEY_TILE);
    const int quads = head_dim / 4;
    for (int tile = tile_begin; tile < tile_end; tile++) {
        int first = tile * KEY_TILE;
        __syncthreads();
        // Four f16 values per 8-byte load.
        for (int i = threadIdx.x; i < KEY_TILE * quads; i += blockDim.x) {
            int j = i / quads, d = (i % quads) * 4;
            float4 kf = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vf = kf;
            if (first + j < kv_len) {
                size_t src = (size_t)(first + j) * head_dim + d;
                uint2 kb = *(const uint2*)(kbase + src), vb = *(const uint2*)(vbase + src);
                kf = make_float4(h2f(kb.x & 0xFFFF), h2f(kb.x >> 16), h2f(kb.y & 0xFFFF), h2f(kb.y >> 16));
                vf = make_float4(h2f(vb.x & 0xFFFF), h2f(vb.x >> 16), h2f(vb.y & 0xFFFF), h2f(vb.y >> 16));
            }
            *(float4*)(ks + j * stride + d) = kf;
            *(float4*)(vs + j * stride + d) = vf;
        }
        __syncthreads();
        if (!active) continue;
        int slot = first + lane;
        float s = NEG_INF;
        if (slot < kv_len && kv_pos[slot] <= my_pos) {
            const float4* kr = (const float4*)(ks + lane * stride);
            const float4* qr = (const float4*)(qs + warp * head_dim);
            float s0 = 0.0f, s1 = 0.0f;
            for (int d = 0; d < quads; d += 2) {
                float4 a = qr[d], b = kr[d];
                s0 += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                if (d + 1 < quads) {
                    float4 c = qr[d + 1], e = kr[d + 1];
                    s1 += c.x * e.x + c.y * e.y + c.z * e.z + c.w * e.w;
                }
            }
            s = s0 + s1;
        }
        float tile_max = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, o));
        if (tile_max == NEG_INF) continue;
        float m_new = fmaxf(m, tile_max);
        float p = (s == NEG_INF) ? 0.0f : __expf(s - m_new);
        float correction = (m == NEG_INF) ? 0.0f : __expf(m - m_new);
        float psum = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffff, psum, o);
        l = l * correction + psum;
        m = m_new;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] *= correction;
        for (int j = 0; j < KEY_TILE; j++) {
            float pj = __shfl_sync(0xffffffff, p, j);
            if (pj != 0.0f) {
                const float* vr = vs + j * stride;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < per_lane) acc[i] += pj * vr[lane + 32 * i];
            }
        }
    }
    if (!active) return;
    size_t pi = ((size_t)qi * n_head + h) * gridDim.z + split;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < per_lane) part_o[pi * head_dim + lane + 32 * i] = acc[i];
    if (lane == 0) {
        part_ml[2 * pi] = m;
        part_ml[2 * pi + 1] = l;
    }
}

// Decode-sized attention (a few queries over a long cache): block (head, split, query), each
// warp walking its share of the split's slots one key at a time with the head's dimensions
// spread over the lanes (coalesced 8-byte reads of f16 keys and values), an online softmax per
// warp, then the block's warps merged into one partial result for attention_combine.
#define DECODE_WARPS 4
// One block's work of attention_decode: query head `h` of query row `qi` (queries at `q`, its
// position `my_pos`) over slots [split * slots_per_split, ...) of the first kv_len of one
// layer's caches (kc, vc at the layer), partial result `pi`.
__device__ __forceinline__ void decode_split(const float* __restrict__ q, const u16* __restrict__ kc,
                                             const u16* __restrict__ vc,
                                             const int* __restrict__ kv_pos, int my_pos,
                                             float* __restrict__ part_o,
                                             float* __restrict__ part_ml, int qi, int h, int split,
                                             size_t pi, int n_head, int kv_heads, int head_dim,
                                             int capacity, int kv_len, float scale,
                                             int slots_per_split) {
    __shared__ float sm_o[DECODE_WARPS][256];
    __shared__ float sm_ml[DECODE_WARPS][2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int kvh = h / (n_head / kv_heads);
    const int per_lane = head_dim / 32;  // 1..8 consecutive dimensions per lane
    float qv[8], acc[8];
    const float* qr = q + ((size_t)qi * n_head + h) * head_dim + lane * per_lane;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        qv[i] = i < per_lane ? qr[i] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const u16* kbase = kc + (size_t)kvh * capacity * head_dim + lane * per_lane;
    const u16* vbase = vc + (size_t)kvh * capacity * head_dim + lane * per_lane;
    const int begin = split * slots_per_split;
    const int end = min(begin + slots_per_split, kv_len);
    for (int slot = begin + warp; slot < end; slot += DECODE_WARPS) {
        if (kv_pos[slot] > my_pos) continue;  // uniform across the warp
        const u16* kr = kbase + (size_t)slot * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < per_lane) s += qv[i] * h2f(kr[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        float m_new = fmaxf(m, s);
        float correction = __expf(m - m_new);  // 0 while m is -inf
        float p = __expf(s - m_new);
        l = l * correction + p;
        m = m_new;
        const u16* vr = vbase + (size_t)slot * head_dim;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < per_lane) acc[i] = acc[i] * correction + p * h2f(vr[i]);
    }
    // Merge the warps: rescale each to the block's maximum.
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < per_lane) sm_o[warp][lane * per_lane + i] = acc[i];
    if (lane == 0) {
        sm_ml[warp][0] = m;
        sm_ml[warp][1] = l;
    }
    __syncthreads();
    if (warp != 0) return;
    float bm = NEG_INF;
    for (int w = 0; w < DECODE_WARPS; w++) bm = fmaxf(bm, sm_ml[w][0]);
    float bl = 0.0f, o[8];
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = 0.0f;
    if (bm != NEG_INF) {
        for (int w = 0; w < DECODE_WARPS; w++) {
            if (sm_ml[w][0] == NEG_INF) continue;
            float f = __expf(sm_ml[w][0] - bm);
            bl += f * sm_ml[w][1];
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (i < per_lane) o[i] += f * sm_o[w][lane * per_lane + i];
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < per_lane) part_o[pi * head_dim + lane * per_lane + i] = o[i];
    if (lane == 0) {
        part_ml[2 * pi] = bm;
        part_ml[2 * pi + 1] = bl;
    }
}

extern "C" __global__ void attention_decode(const float* __restrict__ q, const u16* __restrict__ kc,
                                            const u16* __restrict__ vc, const int* __restrict__ kv_pos,
                                            const int* __restrict__ q_pos, float* __restrict__ part_o,
                                            float* __restrict__ part_ml, int n_head, int kv_heads,
                                            int head_dim, int capacity, int kv_len, float scale,
                                            int slots_per_split) {
    const int h = blockIdx.x, split = blockIdx.y, qi = blockIdx.z, splits = gridDim.y;
    size_t pi = ((size_t)qi * n_head + h) * splits + split;
    decode_split(q, kc, vc, kv_pos, q_pos[qi], part_o, part_ml, qi, h, split, pi, n_head,
                 kv_heads, head_dim, capacity, kv_len, scale, slots_per_split);
}

// The caches of one sequence of a batched decode step (Device::write_seq_table): every layer's
// keys and values ([layer][kv_head][capacity][head_dim] f16), the slots' positions, the capacity
// and the slots in use after this step's rows.
struct SeqCache {
    const u16* keys;
    const u16* values;
    const int* kv_pos;
    int capacity;
    int kv_len;
    int splits;  // this sequence's slot ranges: as attention_decode would split them alone
    int pad;
};

// attention_decode for rows of several sequences in one launch: row qi belongs to sequence
// seq_of_row[qi], whose caches (at layer `layer`) and slots it attends over, split in that
// sequence's own number of ranges (so each row's result is exactly what attention_decode gives
// it alone); the blocks past them write empty partials, which attention_combine skips.
extern "C" __global__ void attention_decode_many(const float* __restrict__ q,
                                                 const SeqCache* __restrict__ seqs,
                                                 const int* __restrict__ seq_of_row,
                                                 const int* __restrict__ q_pos,
                                                 float* __restrict__ part_o,
                                                 float* __restrict__ part_ml, int n_head,
                                                 int kv_heads, int head_dim, int layer,
                                                 float scale) {
    const int h = blockIdx.x, split = blockIdx.y, qi = blockIdx.z, splits = gridDim.y;
    const SeqCache c = seqs[seq_of_row[qi]];
    size_t pi = ((size_t)qi * n_head + h) * splits + split;
    if (split >= c.splits) {  // uniform across the block
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) part_o[pi * head_dim + d] = 0.0f;
        if (threadIdx.x == 0) {
            part_ml[2 * pi] = NEG_INF;
            part_ml[2 * pi + 1] = 0.0f;
        }
        return;
    }
    const size_t layer_off = (size_t)layer * kv_heads * c.capacity * head_dim;
    const int per_split = (c.kv_len + c.splits - 1) / c.splits;
    decode_split(q, c.keys + layer_off, c.values + layer_off, c.kv_pos, q_pos[qi], part_o,
                 part_ml, qi, h, split, pi, n_head, kv_heads, head_dim, c.capacity, c.kv_len,
                 scale, per_split);
}

// kv_store for rows of several sequences: row t's keys and values go to slot slots[t] of layer
// `layer` of sequence seq_of_row[t]'s caches.
extern "C" __global__ void kv_store_many(const float* k, const float* v, const SeqCache* seqs,
                                         const int* seq_of_row, const int* slots, int layer,
                                         int kv_heads, int head_dim) {
    int t = blockIdx.x;
    const SeqCache c = seqs[seq_of_row[t]];
    size_t layer_off = (size_t)layer * kv_heads * head_dim * c.capacity;
    kv_store_row(k, v, (u16*)c.keys + layer_off, (u16*)c.values + layer_off, t,
                 (size_t)slots[t], kv_heads, head_dim, c.capacity);
}

// ---- Prefill attention on cuBLAS: S = Q K^T and O = P V as batched GEMMs over the KV heads
// (each KV head's query heads stacked), a masked softmax in between.

// out[h][t][d] = f16(q[t][h][d]): the call's queries by head, for the batched GEMMs.
extern "C" __global__ void heads_to_f16(const float* q, u16* out, int n, int n_head, int head_dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t total = (size_t)n * n_head * head_dim;
    if (i >= total) return;
    int d = i % head_dim;
    size_t th = i / head_dim;  // t * n_head + h
    int h = th % n_head;
    size_t t = th / n_head;
    out[((size_t)h * n + t) * head_dim + d] = f2h(q[i]);
}

// out[t][h][d] = o[h][t][d].
extern "C" __global__ void heads_from(const float* o, float* out, int n, int n_head, int head_dim) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t total = (size_t)n * n_head * head_dim;
    if (i >= total) return;
    int d = i % head_dim;
    size_t th = i / head_dim;
    int h = th % n_head;
    size_t t = th / n_head;
    out[i] = o[((size_t)h * n + t) * head_dim + d];
}

// Row r = h * n + t of the scores s ([n_head][n][kv_len], already scaled) to probabilities p
// (f16) over the slots visible to query t (kv_pos[j] <= q_pos[t]); a row with none is zeros.
extern "C" __global__ void softmax_masked(const float* s, u16* p, const int* kv_pos,
                                          const int* q_pos, int n, int kv_len) {
    __shared__ float shared[32];
    size_t r = blockIdx.x;
    int t = r % n;
    const int pos = q_pos[t];
    const float* sr = s + r * kv_len;
    u16* pr = p + r * kv_len;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < kv_len; j += blockDim.x)
        if (kv_pos[j] <= pos) m = fmaxf(m, sr[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) shared[warp] = m;
    __syncthreads();
    m = NEG_INF;
    for (int w = 0; w < warps; w++) m = fmaxf(m, shared[w]);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < kv_len; j += blockDim.x)
        if (kv_pos[j] <= pos) sum += __expf(sr[j] - m);
    sum = block_sum(sum, shared);
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int j = threadIdx.x; j < kv_len; j += blockDim.x)
        pr[j] = f2h(kv_pos[j] <= pos ? __expf(sr[j] - m) * inv : 0.0f);
}

// Merges the splits' partial results of each (query, head): one block of head_dim threads each.
extern "C" __global__ void attention_combine(const float* part_o, const float* part_ml, float* out,
                                             int n_head, int head_dim, int splits) {
    size_t qh = blockIdx.x;  // query * n_head + head
    int d = threadIdx.x;
    float m = NEG_INF;
    for (int s = 0; s < splits; s++) m = fmaxf(m, part_ml[2 * (qh * splits + s)]);
    float l = 0.0f, o = 0.0f;
    if (m != NEG_INF) {
        for (int s = 0; s < splits; s++) {
            float ms = part_ml[2 * (qh * splits + s)];
            if (ms == NEG_INF) continue;
            float w = __expf(ms - m);
            l += w * part_ml[2 * (qh * splits + s) + 1];
            o += w * part_o[(qh * splits + s) * head_dim + d];
        }
    }
    out[qh * head_dim + d] = l > 0.0f ? o / l : 0.0f;
}

// Fused gradient pack: one pass over a layer's flat gradient that
//   (1) writes grad * scale in the host-copy dtype (bf16) into `out` (device staging for the D2H copy),
//   (2) accumulates the squared L2 norm of grad * scale in fp32 into `sumsq[0]` (for exact clipping
//       and the non-finite check), instead of a separate norm pass and a separate cast pass.
// Reference: fuyou/device/kernels.py::grad_pack_reference (torch ops). Parity: tests/gpu/test_kernels.py.
//
// Launch: grid = min(ceil(n / (BLOCK * ITEMS)), 4096) blocks of BLOCK threads; sumsq zeroed first.
// Accumulation order differs from torch's vector_norm, so sumsq agrees to fp32 rounding, not bits;
// `out` is bit-identical to (grad.float() * scale).to(bf16) (round-to-nearest-even).
#include <cuda_bf16.h>

#define BLOCK 256

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ void block_add(float local, float* sumsq) {
    __shared__ float partial[BLOCK / 32];
    float w = warp_sum(local);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = w;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < BLOCK / 32 ? partial[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) atomicAdd(sumsq, v);
    }
}

extern "C" __global__ void grad_pack_bf16(const __nv_bfloat16* __restrict__ grad, __nv_bfloat16* __restrict__ out,
                                          float scale, float* __restrict__ sumsq, long long n) {
    float local = 0.0f;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK) {
        float g = __bfloat162float(grad[i]) * scale;
        out[i] = __float2bfloat16_rn(g);
        local = fmaf(g, g, local);
    }
    block_add(local, sumsq);
}

extern "C" __global__ void grad_pack_f32(const float* __restrict__ grad, float* __restrict__ out,
                                         float scale, float* __restrict__ sumsq, long long n) {
    float local = 0.0f;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK) {
        float g = grad[i] * scale;
        out[i] = g;
        local = fmaf(g, g, local);
    }
    block_add(local, sumsq);
}

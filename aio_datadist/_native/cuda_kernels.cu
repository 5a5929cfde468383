// cuda_kernels.cu: device code of the CUDA runtime, shipped as PTX in cuda_kernels_ptx.h.
//
// Regenerate the header with `python tools/gen_cuda_ptx.py` (needs nvcc); the build itself
// never compiles this file. The PTX is loaded at run time with cudaLibraryLoadData, so one
// wheel serves every GPU the driver can JIT it for.

// Copy every row (dst, src, nbytes) of `ops` (device memory, n rows). One block per row at a
// time, striding over rows; 16-byte words when a row allows it, four loads in flight per
// thread before their stores. Rows must not overlap each other's destinations.
extern "C" __global__ void dd_copy_rows(const unsigned long long *ops, unsigned long long n)
{
    const unsigned long long step = blockDim.x;
    for (unsigned long long row = blockIdx.x; row < n; row += gridDim.x) {
        const unsigned long long dst = ops[3 * row];
        const unsigned long long src = ops[3 * row + 1];
        const unsigned long long len = ops[3 * row + 2];
        unsigned long long i = threadIdx.x;
        if (((dst | src | len) & 15ull) == 0) {
            uint4 *d = reinterpret_cast<uint4 *>(dst);
            const uint4 *s = reinterpret_cast<const uint4 *>(src);
            const unsigned long long words = len >> 4;
            for (; i + 3 * step < words; i += 4 * step) {
                const uint4 a = s[i], b = s[i + step], c = s[i + 2 * step], e = s[i + 3 * step];
                d[i] = a;
                d[i + step] = b;
                d[i + 2 * step] = c;
                d[i + 3 * step] = e;
            }
            for (; i < words; i += step)
                d[i] = s[i];
        } else if (((dst | src | len) & 3ull) == 0) {
            unsigned int *d = reinterpret_cast<unsigned int *>(dst);
            const unsigned int *s = reinterpret_cast<const unsigned int *>(src);
            for (const unsigned long long words = len >> 2; i < words; i += step)
                d[i] = s[i];
        } else {
            unsigned char *d = reinterpret_cast<unsigned char *>(dst);
            const unsigned char *s = reinterpret_cast<const unsigned char *>(src);
            for (; i < len; i += step)
                d[i] = s[i];
        }
    }
}

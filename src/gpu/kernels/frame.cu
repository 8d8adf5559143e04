// Page frames on the device (format/SPEC.md 5-6): the bytes of a kvpack
// file placed into a device buffer, the CRC-32 of every page body and of the
// index body, and the CRC fields of page headers, index entries and the
// index header filled in, so a file encoded on the GPU is complete in device
// memory without passing through the host (gpu::frame plans the spans).
//
// CRC-32 is ISO-HDLC (reflected polynomial 0xEDB88320, initial value and
// final xor 0xFFFFFFFF), the CRC of the crc32fast crate. A span is split
// into FRAME_THREADS chunks of equal length L, the span being read as if
// preceded by 256 * L - len zero bytes: the CRC register without initial
// value or final xor (the "raw" CRC) of leading zeros is zero, so every chunk
// has the same length and two neighbouring chunks combine as
// raw(A || B) = raw(A) * x^(8 |B|) mod P xor raw(B). The initial value is
// added once at the end: crc(M) = ~(raw(M) xor 0xFFFFFFFF * x^(8 |M|) mod P).
// The polynomial arithmetic is zlib's multmodp / x2nmodp (the combination
// of CRCs described by M. Adler for crc32_combine).

#define FRAME_THREADS 256
#define CRC_POLY 0xedb88320u

// One contiguous copy.
struct FrameCopy {
    u64 src;
    u64 dst;
    u64 len;
};

// One CRC: `len` bytes at `at`; the CRC goes to `out[i]` for span i.
struct FrameCrcSpan {
    u64 at;
    u64 len;
};

// One page to seal: its header's device address and the address of its
// index entry's body_crc field.
struct FrameSeal {
    u64 header;
    u64 entry_crc;
};

// a(x) * b(x) modulo P(x), reflected (bit 31 is x^0).
__device__ __forceinline__ u32 crc_multmodp(u32 a, u32 b) {
    u32 m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return p;
}

// x^(n * 2^k) modulo P(x).
__device__ __forceinline__ u32 crc_x2nmodp(u64 n, u32 k) {
    u32 p = 1u << 31;    // x^0
    u32 x2k = 1u << 30;  // x^1, squared k times below
    for (u32 i = 0; i < k; i++) x2k = crc_multmodp(x2k, x2k);
    while (n) {
        if (n & 1) p = crc_multmodp(x2k, p);
        n >>= 1;
        x2k = crc_multmodp(x2k, x2k);
    }
    return p;
}

// The byte table of the reflected CRC, one entry per thread.
__device__ __forceinline__ void crc_table_init(u32* table) {
    for (u32 n = threadIdx.x; n < 256; n += blockDim.x) {
        u32 c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC_POLY : c >> 1;
        table[n] = c;
    }
    __syncthreads();
}

// The standard CRC-32 of `len` bytes at `p`, serially (short spans).
__device__ __forceinline__ u32 crc_serial(const u32* table, const u8* p, u32 len) {
    u32 c = 0xffffffffu;
    for (u32 i = 0; i < len; i++) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return ~c;
}

// Copies: work item (copy, chunk of 64 KiB); 16-byte moves when the source,
// destination and length allow, else bytes.
extern "C" __global__ void __launch_bounds__(FRAME_THREADS)
    frame_copy(const FrameCopy* __restrict__ copies, const uint2* __restrict__ work) {
    uint2 w = work[blockIdx.x];
    FrameCopy c = copies[w.x];
    u64 lo = (u64)w.y << 16;
    if (lo >= c.len) return;
    u64 hi = min(c.len, lo + (1ull << 16));
    const u8* s = (const u8*)c.src;
    u8* d = (u8*)c.dst;
    if (((c.src | c.dst | lo | hi) & 15) == 0) {
        for (u64 i = lo + 16 * threadIdx.x; i < hi; i += 16 * FRAME_THREADS)
            *(uint4*)(d + i) = *(const uint4*)(s + i);
    } else {
        for (u64 i = lo + threadIdx.x; i < hi; i += FRAME_THREADS) d[i] = s[i];
    }
}

// CRC-32 of each span (one block per span) into out[span].
extern "C" __global__ void __launch_bounds__(FRAME_THREADS)
    frame_crc(const FrameCrcSpan* __restrict__ spans, u32* __restrict__ out) {
    __shared__ u32 table[256];
    __shared__ u32 part[FRAME_THREADS];
    __shared__ u32 shift[8];
    crc_table_init(table);
    FrameCrcSpan s = spans[blockIdx.x];
    u64 L = (s.len + FRAME_THREADS - 1) / FRAME_THREADS;
    u64 pad = L * FRAME_THREADS - s.len;  // conceptual leading zeros
    const u8* p = (const u8*)s.at;
    // Raw CRC of this thread's chunk [t L, (t+1) L) of the padded span.
    u64 a = (u64)threadIdx.x * L, b = a + L;
    u64 first = a > pad ? a - pad : 0, end = b > pad ? b - pad : 0;
    u32 c = 0;
    for (u64 i = first; i < end; i++) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    part[threadIdx.x] = c;
    // x^(8 L 2^k) for the tree levels k = 0..7.
    if (threadIdx.x < 8) shift[threadIdx.x] = crc_x2nmodp(L, 3 + threadIdx.x);
    __syncthreads();
    for (u32 k = 0, stride = 1; stride < FRAME_THREADS; k++, stride *= 2) {
        u32 t = threadIdx.x;
        if (t % (2 * stride) == 0)
            part[t] = crc_multmodp(shift[k], part[t]) ^ part[t + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[blockIdx.x] = ~(part[0] ^ crc_multmodp(crc_x2nmodp(s.len, 3), 0xffffffffu));
}

// Page headers (format/SPEC.md 6.1): body_crc from crcs[i] at offset 40,
// the header CRC of bytes 0..60 at 60, and the same body_crc into the
// page's index entry. One thread per page.
extern "C" __global__ void __launch_bounds__(FRAME_THREADS)
    frame_seal_pages(const FrameSeal* __restrict__ seals, const u32* __restrict__ crcs, u32 n) {
    __shared__ u32 table[256];
    crc_table_init(table);
    u32 i = blockIdx.x * FRAME_THREADS + threadIdx.x;
    if (i >= n) return;
    FrameSeal s = seals[i];
    u8* h = (u8*)s.header;
    u32 c = crcs[i];
    u8* e = (u8*)s.entry_crc;
    for (int k = 0; k < 4; k++) {
        h[40 + k] = (u8)(c >> (8 * k));
        e[k] = (u8)(c >> (8 * k));
    }
    u32 hc = crc_serial(table, h, 60);
    for (int k = 0; k < 4; k++) h[60 + k] = (u8)(hc >> (8 * k));
}

// The index frame header (format/SPEC.md 5.2): body_crc = *crc at offset
// 40, then the header CRC of bytes 0..60 at 60. One thread.
extern "C" __global__ void __launch_bounds__(FRAME_THREADS)
    frame_seal_index(u64 header, const u32* __restrict__ crc) {
    __shared__ u32 table[256];
    crc_table_init(table);
    if (threadIdx.x != 0) return;
    u8* h = (u8*)header;
    u32 c = *crc;
    for (int k = 0; k < 4; k++) h[40 + k] = (u8)(c >> (8 * k));
    u32 hc = crc_serial(table, h, 60);
    for (int k = 0; k < 4; k++) h[60 + k] = (u8)(hc >> (8 * k));
}

// out[i] = 1 when span i holds a non-zero byte, else 0 (one block per
// span): the padding a reader must find zero (format/SPEC.md 6.1-6.2).
extern "C" __global__ void __launch_bounds__(FRAME_THREADS)
    frame_zero(const FrameCrcSpan* __restrict__ spans, u32* __restrict__ out) {
    __shared__ u32 any;
    if (threadIdx.x == 0) any = 0;
    __syncthreads();
    FrameCrcSpan s = spans[blockIdx.x];
    const u8* p = (const u8*)s.at;
    u32 mine = 0;
    for (u64 i = threadIdx.x; i < s.len; i += FRAME_THREADS) mine |= p[i];
    if (mine) any = 1;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = any;
}

// The paged-attention kernel built for AVX2 + FMA + F16C (every x86-64 CPU kvserve runs on).
#define KVSERVE_PAGED_SELECT select_avx2
#include "cache_manager/paged_attention_kernel.inc"

// The paged-attention kernel built for AVX-512 F/BW/VL; paged_attention.cpp calls it only where the
// CPU reports them (select_avx512 returns null elsewhere).
#define KVSERVE_PAGED_SELECT select_avx512
#include "cache_manager/paged_attention_kernel.inc"

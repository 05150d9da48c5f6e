/* Prints "<typedef name> <sizeof>" for every struct of attn.h, the sizes the
 * C compiler gives them, for test_bench_ffi.py to compare with the ctypes
 * mirrors in bench/attn_ffi.py. That test also fails when attn.h gains a
 * struct missing here. */
#include <stdio.h>

#include "attn/attn.h"

#define PRINT_SIZE(type) printf("%s %zu\n", #type, sizeof(type))

int main(void) {
  PRINT_SIZE(attn_plan_info_t);
  PRINT_SIZE(attn_kv_cache_config_t);
  PRINT_SIZE(attn_kv_cache_info_t);
  PRINT_SIZE(attn_decode_config_t);
  PRINT_SIZE(attn_decode_step_info_t);
  PRINT_SIZE(attn_decode_plan_info_t);
  PRINT_SIZE(attn_ring_plan_info_t);
  /* Enumerations cross the boundary as int32_t (c_int32 in ctypes). */
  PRINT_SIZE(attn_status_t);
  return 0;
}

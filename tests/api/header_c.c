/* Compiles attn.h as strict C (c89, c99 and c11, -Wall -Wextra -Werror -pedantic,
 * set by tests/api/meson.build), checks a few compile-time facts and that the
 * declarations have the expected types, then links and runs against the
 * library. */
#include <attn/attn.h>
#include <attn/attn.h> /* the include guard works */

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define CHECK(name, cond) _Static_assert(cond, #name)
#else
#define CHECK(name, cond) typedef char check_##name[(cond) ? 1 : -1]
#endif

CHECK(version_number, ATTN_VERSION_NUMBER == ATTN_VERSION_MAJOR * 10000 + ATTN_VERSION_MINOR * 100 +
                                                 ATTN_VERSION_PATCH);
CHECK(success_is_zero, ATTN_STATUS_SUCCESS == 0);
CHECK(last_status, ATTN_STATUS_INTERNAL_ERROR == 10);
CHECK(max_dims, ATTN_MAX_DIMS == 8);
CHECK(info_struct_size_first, offsetof(attn_plan_info_t, struct_size) == 0);
CHECK(info_struct_size_u64, sizeof(((attn_plan_info_t *)0)->struct_size) == 8);

/* The exact prototypes, through typed function pointers (a mismatch is a
 * compile error with -Werror). */
static attn_status_t (*const p_ctx_create)(attn_backend_t, int32_t, int32_t, attn_context_t *) =
    attn_context_create;
static attn_status_t (*const p_ctx_destroy)(attn_context_t) = attn_context_destroy;
static attn_status_t (*const p_set_shape)(attn_plan_desc_t, int64_t, int64_t, int64_t, int64_t,
                                          int64_t, int64_t, int64_t) = attn_plan_desc_set_shape;
static attn_status_t (*const p_forward)(attn_plan_t, const void *, const void *, const void *, void *,
                                        float *, void *, size_t, void *) = attn_forward;
static attn_status_t (*const p_backward)(attn_plan_t, const void *, const void *, const void *,
                                         const void *, const float *, const void *, void *, void *,
                                         void *, void *, size_t, void *) = attn_backward;
static attn_status_t (*const p_merge)(attn_context_t, int32_t, attn_tensor_desc_t, attn_tensor_desc_t,
                                      const void *const *, const float *const *, void *, float *,
                                      void *) = attn_merge_states;
static const char *(*const p_status_string)(attn_status_t) = attn_status_string;

int main(void) {
  attn_context_t ctx = NULL;
  char expect[32];
  attn_plan_info_t info;
  attn_kv_cache_t reserved_cache = NULL; /* reserved handle types exist */
  attn_comm_t reserved_comm = NULL;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  (void)reserved_cache;
  (void)reserved_comm;
  (void)p_set_shape, (void)p_forward, (void)p_backward, (void)p_merge;

  if (attn_version_number() != ATTN_VERSION_NUMBER) {
    fprintf(stderr, "header/library skew: %u vs %d\n", (unsigned)attn_version_number(),
            ATTN_VERSION_NUMBER);
    return 1;
  }
  sprintf(expect, "%d.%d.%d", ATTN_VERSION_MAJOR, ATTN_VERSION_MINOR, ATTN_VERSION_PATCH); /* (C89: no snprintf) */
  if (strcmp(attn_version_string(), expect) != 0) return 1;
  if (strcmp(p_status_string(ATTN_STATUS_SUCCESS), "ATTN_STATUS_SUCCESS") != 0) return 1;
  if (p_ctx_create(ATTN_BACKEND_CPU, 0, 1, &ctx) != ATTN_STATUS_SUCCESS) return 1;
  if (p_ctx_destroy(ctx) != ATTN_STATUS_SUCCESS) return 1;
  printf("attn.h OK as C (__STDC_VERSION__ %ld), library %s\n",
#ifdef __STDC_VERSION__
         (long)__STDC_VERSION__,
#else
         0L,
#endif
         attn_version_string());
  return 0;
}

/* Replaces malloc and its relatives in the executable whose one source file
 * includes this header, forwarding to glibc's __libc_* functions. The C++
 * runtime's operator new calls malloc, so the library's allocations pass
 * here too. Needs glibc and no sanitizer (a sanitizer replaces malloc
 * itself).
 *
 * The includer defines, before the include:
 *   static int alloc_hook_fails(void);     called before each allocation;
 *                                          nonzero fails it (NULL, ENOMEM)
 *   static void *alloc_hook_new(void *p);  each new block (NULL when glibc
 *                                          failed); returns p
 *   static void alloc_hook_free(void *p);  called before each free
 *
 * C99 + glibc. */
#ifndef ATTN_TESTS_REPLACE_MALLOC_H
#define ATTN_TESTS_REPLACE_MALLOC_H

#include <errno.h>
#include <stddef.h>

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);
extern void *__libc_memalign(size_t align, size_t n);
extern void __libc_free(void *p);

void *malloc(size_t n) { return alloc_hook_fails() ? NULL : alloc_hook_new(__libc_malloc(n)); }
void *calloc(size_t n, size_t size) {
  return alloc_hook_fails() ? NULL : alloc_hook_new(__libc_calloc(n, size));
}
void *realloc(void *p, size_t n) {
  if (alloc_hook_fails()) return NULL;
  void *q = __libc_realloc(p, n);
  return p == NULL ? alloc_hook_new(q) : q; /* a resized block is not a new one */
}
void free(void *p) {
  alloc_hook_free(p);
  __libc_free(p);
}
void *memalign(size_t align, size_t n) {
  return alloc_hook_fails() ? NULL : alloc_hook_new(__libc_memalign(align, n));
}
void *aligned_alloc(size_t align, size_t n) {
  return alloc_hook_fails() ? NULL : alloc_hook_new(__libc_memalign(align, n));
}
int posix_memalign(void **out, size_t align, size_t n) {
  if (alloc_hook_fails()) return ENOMEM;
  void *p = alloc_hook_new(__libc_memalign(align, n));
  if (p == NULL) return ENOMEM;
  *out = p;
  return 0;
}

#endif

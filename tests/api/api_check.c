/* Checks shared by the API contract tests (see api_check.h). C99. */
#include "api_check.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

static int is_ident_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

int contains_word(const char *msg, const char *word) {
  const size_t n = strlen(word);
  const char *p = msg;
  while ((p = strstr(p, word)) != NULL) {
    const int left_ok = p == msg || !is_ident_char(p[-1]) || !is_ident_char(word[0]);
    const int right_ok = p[n] == '\0' || !is_ident_char(p[n]) || !is_ident_char(word[n - 1]);
    if (left_ok && right_ok) return 1;
    ++p;
  }
  return 0;
}

void check_status_message(attn_status_t got, attn_status_t want, const char *word,
                          const char *message, const char *expr, const char *file, int line) {
  int ok = got == want && message != NULL;
  if (ok && want == ATTN_STATUS_SUCCESS) ok = message[0] == '\0';
  if (ok && want != ATTN_STATUS_SUCCESS)
    ok = message[0] != '\0' && (!word || contains_word(message, word));
  if (!ok) {
    print_error("%s:%d: %s\n  expected %s%s%s%s\n  got      %s, message \"%s\"\n", file, line, expr,
                attn_status_string(want), word ? " naming \"" : "", word ? word : "",
                word ? "\"" : "", attn_status_string(got), message ? message : "(NULL)");
    _fail(file, line);
  }
}

void check_status(attn_status_t got, attn_status_t want, const char *word, const char *expr,
                  const char *file, int line) {
  check_status_message(got, want, word, attn_last_error_message(), expr, file, line);
}

void check_success(attn_status_t got, const char *expr, const char *file, int line) {
  if (got != ATTN_STATUS_SUCCESS) {
    print_error("%s:%d: %s failed: %s: %s\n", file, line, expr, attn_status_string(got),
                attn_last_error_message());
    _fail(file, line);
  }
}

void poison(void *p, size_t n) { memset(p, POISON_BYTE, n); }

int is_poisoned(const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  size_t i;
  for (i = 0; i < n; ++i)
    if (b[i] != POISON_BYTE) return 0;
  return 1;
}

void check_poisoned(const void *p, size_t n, const char *what, const char *file, int line) {
  const unsigned char *b = (const unsigned char *)p;
  size_t i;
  for (i = 0; i < n; ++i) {
    if (b[i] != POISON_BYTE) {
      print_error("%s:%d: output %s was written by a failed call (byte %zu of %zu is 0x%02x)\n", file,
                  line, what, i, n, b[i]);
      _fail(file, line);
    }
  }
}

void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  assert_non_null(p);
  return p;
}

void fill_random(float *x, size_t n, unsigned seed) {
  uint32_t s = seed * 2654435761u + 12345u;
  size_t i;
  for (i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = (float)(s >> 8) / 8388608.0f - 1.0f;
    if (x[i] == 0.0f) x[i] = 0.5f;
  }
}

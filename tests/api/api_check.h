/* Checks shared by the API contract tests: a call's status and message,
 * outputs left untouched by a failed call, and deterministic inputs.
 *
 * A failing call must return the documented status with a message that
 * names the offending argument as a whole word ("q" does not match inside
 * "seqlen_q"); a successful one leaves the message empty. Outputs are
 * poisoned with POISON_BYTE before a call that must fail and compared
 * byte for byte after it.
 *
 * C99. */
#ifndef ATTN_TESTS_API_CHECK_H
#define ATTN_TESTS_API_CHECK_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <attn/attn.h>

#define POISON_BYTE 0xA5

/* Does `word` occur in msg with no identifier character glued to either end? */
int contains_word(const char *msg, const char *word);

/* Fails the test unless got == want and `message` fits: empty on success;
 * non-empty and naming `word` (when not NULL) on failure. `expr` names the
 * call in the report. For a message captured elsewhere (another thread). */
void check_status_message(attn_status_t got, attn_status_t want, const char *word,
                          const char *message, const char *expr, const char *file, int line);

/* The same with this thread's attn_last_error_message(). */
void check_status(attn_status_t got, attn_status_t want, const char *word, const char *expr,
                  const char *file, int line);

/* EXPECT_FAIL(status, "argname", call): the call fails with that status and
 * the message names argname. EXPECT_OK(call): success, message "". */
#define EXPECT_FAIL(status, word, call) check_status((call), (status), (word), #call, __FILE__, __LINE__)
#define EXPECT_OK(call) check_status((call), ATTN_STATUS_SUCCESS, NULL, #call, __FILE__, __LINE__)

/* CHECK_OK(call): the call succeeds (its message is not checked): for the
 * set-up of tests that check something else. */
#define CHECK_OK(call) check_success((call), #call, __FILE__, __LINE__)
void check_success(attn_status_t got, const char *expr, const char *file, int line);

void poison(void *p, size_t n);
int is_poisoned(const void *p, size_t n);
/* Fails the test unless all n bytes at p still hold POISON_BYTE. */
void check_poisoned(const void *p, size_t n, const char *what, const char *file, int line);
#define EXPECT_UNTOUCHED(p, n) check_poisoned((p), (n), #p, __FILE__, __LINE__)
/* For an out-parameter variable. */
#define EXPECT_VAR_UNTOUCHED(var) check_poisoned(&(var), sizeof(var), #var, __FILE__, __LINE__)
#define POISON_VAR(var) poison(&(var), sizeof(var))

/* malloc that fails the test instead of returning NULL (n may be 0). */
void *xmalloc(size_t n);

/* Deterministic pseudo-random floats in [-1, 1), never zero. */
void fill_random(float *x, size_t n, unsigned seed);

#endif

/* refit calls during thread and process teardown, from C11: a pthread key destructor and an atexit
 * handler, each on a thread that had a failing call before (its thread-local error storage is gone
 * by then). Every call must return its usual status and a readable message; none may abort. */
#include "check.h"

#include <pthread.h>
#include <unistd.h>

/* Checks made after main returned (or after a thread's function returned) cannot use CHECK, which
 * calls exit(): a failed one ends the process with _exit and a distinct code. */
#define TEARDOWN_CHECK(cond, code)                                                        \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "%s:%d: teardown check failed: %s\n", __FILE__, __LINE__, #cond);   \
      fflush(stderr);                                                                     \
      _exit(code);                                                                        \
    }                                                                                     \
  } while (0)

static void count_record(uint32_t level, const char *message, void *user_data) {
  (void)level;
  (void)message;
  ++*(int *)user_data;
}

/* The calls a program might make while it shuts down: a failing one, the message, a handle made and
 * released, the log callback installed and removed. */
static void calls_at_teardown(int code) {
  size_t size = 0;
  TEARDOWN_CHECK(refit_group_size(NULL, &size) == REFIT_STATUS_NULL_ARGUMENT, code);
  const char *message = refit_last_error_message();
  TEARDOWN_CHECK(message != NULL, code + 1);
  TEARDOWN_CHECK(strstr(message, "NULL_ARGUMENT") != NULL || strstr(message, "is NULL") != NULL, code + 2);
  TEARDOWN_CHECK(strcmp(refit_status_string(REFIT_STATUS_OVERLAP), "REFIT_STATUS_OVERLAP") == 0, code + 3);
  refit_table *table = NULL;
  TEARDOWN_CHECK(refit_table_create(&table) == REFIT_STATUS_SUCCESS, code + 4);
  refit_table_destroy(table);
  int records = 0;
  TEARDOWN_CHECK(refit_set_log_callback(5, count_record, &records) == REFIT_STATUS_SUCCESS, code + 5);
  TEARDOWN_CHECK(refit_group_size(NULL, NULL) == REFIT_STATUS_NULL_ARGUMENT, code + 6);
  TEARDOWN_CHECK(records > 0, code + 7);
  TEARDOWN_CHECK(refit_set_log_callback(2, NULL, NULL) == REFIT_STATUS_SUCCESS, code + 8);
  TEARDOWN_CHECK(refit_set_log_callback(9, NULL, NULL) == REFIT_STATUS_INVALID_ARGUMENT, code + 9);
  TEARDOWN_CHECK(refit_last_error_message() != NULL, code + 10);
}

static pthread_key_t key;
static int key_destructor_ran = 0;

static void key_destructor(void *value) {
  (void)value;
  calls_at_teardown(20);
  key_destructor_ran++;
}

/* A failing call first, so that the thread's error storage exists and is destroyed (before the key
 * destructor runs) when the thread exits. A thread whose first refit call is made from a key
 * destructor is tested in tests/child_process.rs (a_group_lives_and_dies_in_exit_handlers): its
 * storage, made after the thread's destructors ran, is never freed, which valgrind would report. */
static void *thread_main(void *arg) {
  (void)arg;
  size_t size = 0;
  if (refit_group_size(NULL, &size) != REFIT_STATUS_NULL_ARGUMENT) return (void *)1;
  if (pthread_setspecific(key, &key) != 0) return (void *)1;
  return NULL;
}

static void at_exit(void) {
  calls_at_teardown(40);
  printf("teardown calls survived\n");
  fflush(stdout);
}

int main(void) {
  CHECK(pthread_key_create(&key, key_destructor) == 0);
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, thread_main, NULL) == 0);
  void *result = (void *)1;
  CHECK(pthread_join(thread, &result) == 0);
  CHECK(result == NULL);
  CHECK(key_destructor_ran == 1);

  /* The same on the main thread at process exit: a failing call now, the calls in the handler. */
  CHECK_STATUS(refit_group_size(NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(atexit(at_exit) == 0);
  CHECK_DONE();
}

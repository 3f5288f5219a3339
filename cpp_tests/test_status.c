/* Version, status names and the last error message, from C11. */
#include "check.h"

static int log_calls = 0;
static void count_log(uint32_t level, const char *message, void *user_data) {
  (void)level;
  (void)message;
  (void)user_data;
  log_calls++;
}

/* A callback that calls refit: a failing call (whose record is dropped, not delivered to this
 * callback again) and a replacement of itself (refused from inside the callback). */
static int nested_calls = 0;
static refit_status nested_replace = REFIT_STATUS_SUCCESS;
static void calls_refit(uint32_t level, const char *message, void *user_data) {
  (void)level;
  (void)message;
  (void)user_data;
  nested_calls++;
  size_t size = 0;
  (void)refit_group_size(NULL, &size);
  nested_replace = refit_set_log_callback(2, NULL, NULL);
}

int main(void) {
  CHECK(refit_abi_version() == REFIT_ABI_VERSION);
  CHECK(strcmp(refit_version(), REFIT_VERSION_STRING) == 0);
  CHECK(strcmp(refit_status_string(REFIT_STATUS_SUCCESS), "REFIT_STATUS_SUCCESS") == 0);
  CHECK(strcmp(refit_status_string(REFIT_STATUS_NOT_FOUND), "REFIT_STATUS_NOT_FOUND") == 0);
  CHECK(strcmp(refit_status_string(-1), "REFIT_STATUS_UNKNOWN") == 0);
  CHECK(strcmp(refit_status_string(100000), "REFIT_STATUS_UNKNOWN") == 0);

  CHECK_STATUS(refit_set_log_callback(6, count_log, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "refit_set_log_callback") != NULL);
  CHECK(strstr(refit_last_error_message(), "level 6") != NULL);
  CHECK_OK(refit_set_log_callback(5, count_log, NULL));
  /* A failing call at debug level logs through the callback. */
  CHECK_STATUS(refit_set_log_callback(7, count_log, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(log_calls > 0);
  CHECK_OK(refit_set_log_callback(2, NULL, NULL));

  CHECK_OK(refit_set_log_callback(4, calls_refit, NULL));
  size_t size = 0;
  CHECK_STATUS(refit_group_size(NULL, &size), REFIT_STATUS_NULL_ARGUMENT);
  CHECK(nested_calls == 1);
  CHECK(nested_replace == REFIT_STATUS_INVALID_STATE);
  CHECK(strcmp(refit_last_error_message(), "refit_group_size: group is NULL") == 0);
  CHECK_OK(refit_set_log_callback(2, NULL, NULL));
  CHECK_DONE();
}

/* The device group and allgather from C11, on the host backend (CI has no GPU): creation errors,
 * queries, scopes, run with per-rank allgather, error propagation and release, every bad argument. */
#include <stdint.h>

#include "check.h"

#define N 3

static refit_group *make_host_group(const int32_t *devices, size_t n, refit_status *status) {
  refit_group_options options;
  refit_group *group = NULL;
  CHECK_OK(refit_group_options_init(&options));
  options.backend = REFIT_BACKEND_HOST;
  *status = refit_group_create(devices, n, &options, &group);
  return group;
}

struct job {
  refit_group *group;
  uint8_t send[N][16];
  uint8_t recv[N][3 * 16];
  size_t counts[N];
  size_t other_counts[N]; /* what disagreeing_rank passes instead of counts */
  int32_t failing_rank;     /* -1: none */
  int32_t disagreeing_rank; /* -1: none */
  int32_t absent_rank;      /* -1: none; this rank's callback returns 0 without the collective */
  int32_t ignore_errors;    /* callbacks return 0 whatever their collective returned */
  refit_status rank_status[N];
};

static int32_t rank_body(uint32_t rank, void *stream, void *user_data) {
  struct job *job = (struct job *)user_data;
  if (stream == NULL) return 100;
  if ((int32_t)rank == job->failing_rank) return 42;
  if ((int32_t)rank == job->absent_rank) return 0;
  uint32_t picked = 99;
  const size_t *counts = (int32_t)rank == job->disagreeing_rank ? job->other_counts : job->counts;
  refit_status s = refit_group_allgather_rank(job->group, rank, (uint64_t)(uintptr_t)job->send[rank],
                                              (uint64_t)(uintptr_t)job->recv[rank], counts,
                                              REFIT_ALLGATHER_AUTO, &picked);
  job->rank_status[rank] = s;
  if (job->ignore_errors) return 0;
  if (s == REFIT_STATUS_SUCCESS && picked != REFIT_ALLGATHER_PEER) return 101;
  return (int32_t)s;
}

/* Tries to open and to close a scope from inside a rank callback; records both statuses. */
struct scope_attempt {
  refit_group *group;
  refit_status enter[N], exit[N];
};

static int32_t scope_body(uint32_t rank, void *stream, void *user_data) {
  struct scope_attempt *attempt = (struct scope_attempt *)user_data;
  (void)stream;
  attempt->enter[rank] = refit_group_enter(attempt->group, NULL);
  attempt->exit[rank] = refit_group_exit(attempt->group, REFIT_EXIT_SYNC);
  return 0;
}

static void fill(struct job *job) {
  for (int r = 0; r < N; r++) {
    job->counts[r] = (size_t)(5 + 4 * r); /* 5, 9, 13: uneven */
    job->other_counts[r] = job->counts[r] - (r == N - 1); /* the last block one byte short */
    for (int i = 0; i < 16; i++) job->send[r][i] = (uint8_t)(r * 50 + i + 1);
    memset(job->recv[r], 0xAB, sizeof job->recv[r]);
    job->rank_status[r] = REFIT_STATUS_SUCCESS;
  }
}

static int gathered_ok(const struct job *job) {
  for (int r = 0; r < N; r++) {
    size_t at = 0;
    for (int p = 0; p < N; p++) {
      if (memcmp(job->recv[r] + at, job->send[p], job->counts[p]) != 0) return 0;
      at += job->counts[p];
    }
  }
  return 1;
}

int main(void) {
  refit_status status;
  const int32_t devices[N] = {0, 1, 2};
  const int32_t duplicate[2] = {1, 1};
  const int32_t negative[1] = {-3};

  /* Creation errors, each with its own status. */
  CHECK(make_host_group(devices, 0, &status) == NULL && status == REFIT_STATUS_EMPTY_DEVICE_LIST);
  CHECK(make_host_group(duplicate, 2, &status) == NULL && status == REFIT_STATUS_DUPLICATE_DEVICE);
  CHECK(make_host_group(negative, 1, &status) == NULL && status == REFIT_STATUS_INVALID_DEVICE);
  CHECK(strstr(refit_last_error_message(), "negative") != NULL);
  refit_group_options options;
  CHECK_OK(refit_group_options_init(&options));
  options.backend = REFIT_BACKEND_HOST;
  options.host_devices = 2;
  refit_group *group = (refit_group *)0x1;
  CHECK_STATUS(refit_group_create(devices, N, &options, &group), REFIT_STATUS_INVALID_DEVICE);
  CHECK(group == (refit_group *)0x1); /* outputs untouched on failure */
  options.backend = 7;
  CHECK_STATUS(refit_group_create(devices, 1, &options, &group), REFIT_STATUS_INVALID_ARGUMENT);
  options.backend = REFIT_BACKEND_HOST;
  options.size = 3;
  CHECK_STATUS(refit_group_create(devices, 1, &options, &group), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_group_create(NULL, 2, NULL, &group), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_group_create(devices, 1, NULL, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_group_options_init(NULL), REFIT_STATUS_NULL_ARGUMENT);

  group = make_host_group(devices, N, &status);
  CHECK_OK(status);

  /* Queries. */
  size_t size = 0;
  CHECK_OK(refit_group_size(group, &size));
  CHECK(size == N);
  int32_t device = -1;
  CHECK_OK(refit_group_device(group, 2, &device));
  CHECK(device == 2);
  CHECK_STATUS(refit_group_device(group, N, &device), REFIT_STATUS_INVALID_ARGUMENT);
  {
    /* refit_group_rank_of inverts refit_group_device, on a group whose ranks are not its devices. */
    const int32_t swapped[2] = {2, 0};
    refit_group *other = make_host_group(swapped, 2, &status);
    CHECK_OK(status);
    uint32_t rank = 99;
    CHECK_OK(refit_group_rank_of(other, 2, &rank));
    CHECK(rank == 0);
    CHECK_OK(refit_group_rank_of(other, 0, &rank));
    CHECK(rank == 1);
    rank = 99;
    CHECK_STATUS(refit_group_rank_of(other, 1, &rank), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK(rank == 99); /* outputs untouched on failure */
    CHECK(strstr(refit_last_error_message(), "device 1 is not in the group") != NULL);
    CHECK(strstr(refit_last_error_message(), "[2, 0]") != NULL);
    CHECK_STATUS(refit_group_rank_of(other, -1, &rank), REFIT_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(refit_group_rank_of(other, 0, NULL), REFIT_STATUS_NULL_ARGUMENT);
    CHECK_STATUS(refit_group_rank_of(NULL, 0, &rank), REFIT_STATUS_NULL_ARGUMENT);
    refit_group_destroy(other);
    CHECK_STATUS(refit_group_rank_of(other, 0, &rank), REFIT_STATUS_INVALID_ARGUMENT);
  }
  void *s0 = NULL, *s1 = NULL, *again = NULL;
  CHECK_OK(refit_group_stream(group, 0, &s0));
  CHECK_OK(refit_group_stream(group, 1, &s1));
  CHECK_OK(refit_group_stream(group, 0, &again));
  CHECK(s0 != NULL && s1 != NULL && s0 != s1 && again == s0);
  bool direct = false;
  CHECK_OK(refit_group_peer_access(group, 0, 2, &direct));
  CHECK(direct);
  CHECK_STATUS(refit_group_peer_access(group, 0, N, &direct), REFIT_STATUS_INVALID_ARGUMENT);
  uint32_t backend = 0;
  CHECK_OK(refit_group_backend(group, &backend));
  CHECK(backend == REFIT_BACKEND_HOST);
  CHECK_STATUS(refit_group_size(NULL, &size), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_group_size(group, NULL), REFIT_STATUS_NULL_ARGUMENT);

  /* Scopes: no nesting, no exit without enter, bad mode. */
  CHECK_STATUS(refit_group_exit(group, REFIT_EXIT_SYNC), REFIT_STATUS_INVALID_STATE);
  CHECK_OK(refit_group_enter(group, NULL));
  CHECK_STATUS(refit_group_enter(group, NULL), REFIT_STATUS_INVALID_STATE);
  /* A refused exit does nothing: the scope stays open until an exit with a valid mode. */
  CHECK_STATUS(refit_group_exit(group, 9), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_group_exit(group, 7), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_group_enter(group, NULL), REFIT_STATUS_INVALID_STATE);
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_ASYNC));
  CHECK_STATUS(refit_group_exit(group, REFIT_EXIT_SYNC), REFIT_STATUS_INVALID_STATE);
  void *callers[N] = {NULL, NULL, NULL};
  CHECK_OK(refit_host_stream_create(&callers[1]));
  CHECK_OK(refit_group_enter(group, (void *const *)callers));
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_SYNC));
  CHECK_OK(refit_host_stream_destroy(callers[1]));
  CHECK_STATUS(refit_host_stream_destroy(callers[1]), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_host_stream_destroy(NULL), REFIT_STATUS_NULL_ARGUMENT);
  /* Only streams made by refit_host_stream_create can be destroyed: not a group's own, not a guessed
   * value (handles were once small sequential integers). The group still works below. */
  CHECK_STATUS(refit_host_stream_destroy(s0), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(refit_last_error_message(), "belongs to a group") != NULL);
  for (uintptr_t guess = 0x1000; guess < 0x1000 + 16 * 1024; guess += 16) {
    CHECK_STATUS(refit_host_stream_destroy((void *)guess), REFIT_STATUS_INVALID_ARGUMENT);
  }

  /* run + per-rank allgather, uneven sizes. */
  static struct job job;
  job.group = group;
  job.failing_rank = -1;
  job.disagreeing_rank = -1;
  job.absent_rank = -1;
  fill(&job);
  CHECK_OK(refit_group_run(group, rank_body, &job));
  CHECK(gathered_ok(&job));

  /* Rank 1's callback returns 0 without the collective the others are in: they are released with
     ABORTED naming it (the run waited forever before). Their callbacks return that status: the run
     fails with it; they ignore it and return 0: the run returns ABORTED itself. */
  fill(&job);
  job.absent_rank = 1;
  CHECK_STATUS(refit_group_run(group, rank_body, &job), REFIT_STATUS_CALLBACK_FAILED);
  CHECK(strstr(refit_last_error_message(), "rank 1's callback returned without joining") != NULL);
  CHECK(job.rank_status[0] == REFIT_STATUS_ABORTED && job.rank_status[2] == REFIT_STATUS_ABORTED);
  fill(&job);
  job.ignore_errors = 1;
  CHECK_STATUS(refit_group_run(group, rank_body, &job), REFIT_STATUS_ABORTED);
  CHECK(strstr(refit_last_error_message(), "rank 1's callback returned while other ranks waited") != NULL);
  CHECK(job.rank_status[0] == REFIT_STATUS_ABORTED && job.rank_status[2] == REFIT_STATUS_ABORTED);
  fill(&job);
  job.absent_rank = -1;
  job.ignore_errors = 0;
  CHECK_OK(refit_group_run(group, rank_body, &job));
  CHECK(gathered_ok(&job));

  /* Scopes cannot be opened or closed from a rank callback, inside an open scope or not; the
     refused calls change nothing. */
  static struct scope_attempt attempt;
  attempt.group = group;
  CHECK_OK(refit_group_run(group, scope_body, &attempt));
  for (int r = 0; r < N; r++) {
    CHECK(attempt.enter[r] == REFIT_STATUS_INVALID_STATE && attempt.exit[r] == REFIT_STATUS_INVALID_STATE);
  }
  CHECK_STATUS(refit_group_exit(group, REFIT_EXIT_SYNC), REFIT_STATUS_INVALID_STATE);
  CHECK_OK(refit_group_enter(group, NULL));
  CHECK_OK(refit_group_run(group, scope_body, &attempt));
  for (int r = 0; r < N; r++) {
    CHECK(attempt.enter[r] == REFIT_STATUS_INVALID_STATE && attempt.exit[r] == REFIT_STATUS_INVALID_STATE);
  }
  CHECK_OK(refit_group_exit(group, REFIT_EXIT_SYNC));

  /* Rank 1 fails: the run reports it, the others are released with ABORTED, nothing hangs. */
  fill(&job);
  job.failing_rank = 1;
  CHECK_STATUS(refit_group_run(group, rank_body, &job), REFIT_STATUS_CALLBACK_FAILED);
  CHECK(strstr(refit_last_error_message(), "rank 1 callback returned 42") != NULL);
  CHECK(job.rank_status[0] == REFIT_STATUS_ABORTED && job.rank_status[2] == REFIT_STATUS_ABORTED);
  /* ...and the group is usable afterwards. */
  fill(&job);
  job.failing_rank = -1;
  CHECK_OK(refit_group_run(group, rank_body, &job));
  CHECK(gathered_ok(&job));
  /* Rank 0 passes other counts: every rank's call fails with INVALID_ARGUMENT, nothing is copied,
     and the next call works. */
  fill(&job);
  job.disagreeing_rank = 0;
  CHECK_STATUS(refit_group_run(group, rank_body, &job), REFIT_STATUS_CALLBACK_FAILED);
  for (int r = 0; r < N; r++) CHECK(job.rank_status[r] == REFIT_STATUS_INVALID_ARGUMENT);
  CHECK(job.recv[1][0] == 0xAB);
  fill(&job);
  job.disagreeing_rank = -1;
  CHECK_OK(refit_group_run(group, rank_body, &job));
  CHECK(gathered_ok(&job));
  CHECK_STATUS(refit_group_run(group, NULL, &job), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_group_run(NULL, rank_body, &job), REFIT_STATUS_NULL_ARGUMENT);

  /* Whole-group allgather. */
  fill(&job);
  uint64_t send[N], recv[N];
  for (int r = 0; r < N; r++) {
    send[r] = (uint64_t)(uintptr_t)job.send[r];
    recv[r] = (uint64_t)(uintptr_t)job.recv[r];
  }
  uint32_t picked = 99;
  CHECK_OK(refit_allgather(group, send, recv, job.counts, REFIT_ALLGATHER_HOST, &picked));
  CHECK(picked == REFIT_ALLGATHER_HOST);
  CHECK(gathered_ok(&job));
  fill(&job);
  CHECK_OK(refit_allgather(group, send, recv, job.counts, REFIT_ALLGATHER_PEER, NULL));
  CHECK(gathered_ok(&job));
  CHECK_STATUS(refit_allgather(group, send, recv, job.counts, 17, NULL), REFIT_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(refit_allgather(group, send, recv, job.counts, REFIT_ALLGATHER_NCCL, NULL), REFIT_STATUS_UNSUPPORTED);
  CHECK_STATUS(refit_allgather(group, NULL, recv, job.counts, REFIT_ALLGATHER_AUTO, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_allgather(group, send, NULL, job.counts, REFIT_ALLGATHER_AUTO, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_allgather(group, send, recv, NULL, REFIT_ALLGATHER_AUTO, NULL), REFIT_STATUS_NULL_ARGUMENT);
  CHECK_STATUS(refit_allgather(NULL, send, recv, job.counts, REFIT_ALLGATHER_AUTO, NULL), REFIT_STATUS_NULL_ARGUMENT);
  uint64_t overlapping[N] = {recv[0], recv[0] + 1, recv[2]};
  CHECK_STATUS(refit_allgather(group, send, overlapping, job.counts, REFIT_ALLGATHER_AUTO, NULL), REFIT_STATUS_OVERLAP);
  CHECK_STATUS(refit_group_allgather_rank(group, 0, send[0], recv[0], job.counts, REFIT_ALLGATHER_AUTO, NULL),
               REFIT_STATUS_INVALID_STATE);

  /* Destroying with an open scope drains it; NULL is ignored. */
  CHECK_OK(refit_group_enter(group, NULL));
  refit_group_destroy(group);
  refit_group_destroy(NULL);
  CHECK_DONE();
}

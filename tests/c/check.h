/*
 * check.h: what our C checks share: "OK <check>" lines for passed checks, "FAIL ..." and exit 1
 * on the first failure (with errno, for the calls that set it), and a monotonic clock for
 * bounded waits. Each check program includes it; nothing else does.
 */
#ifndef VRNIC_CHECK_H
#define VRNIC_CHECK_H

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void fail(const char *fmt, ...)
{
	int e = errno;
	va_list ap;
	va_start(ap, fmt);
	printf("FAIL ");
	vprintf(fmt, ap);
	printf(" (errno %d %s)\n", e, strerror(e));
	fflush(stdout);
	va_end(ap);
	exit(1);
}

static void ok(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	printf("OK ");
	vprintf(fmt, ap);
	printf("\n");
	fflush(stdout);
	va_end(ap);
}

static inline double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

#endif

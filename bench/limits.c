/*
 * The physical limits vrnic's figures are compared against, measured on this machine:
 *   limits rtt        round trip of a cache-line ping-pong between two processes through
 *                     shared memory (the floor for any shared-memory message latency), in ns
 *   limits memcpy N   single-thread memcpy bandwidth for N-byte copies, hot, in MB/s
 * Prints the median of several runs.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, n, sizeof *v, cmp);
	return v[n / 2];
}

static double rtt_ns(void)
{
	volatile uint64_t *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	const long iters = 200000;
	w[0] = 0;
	pid_t p = fork();
	if (p == 0) {
		for (long i = 1; i <= iters; i++) {
			while (w[0] != 2 * i - 1)
				;
			w[0] = 2 * i;
		}
		_exit(0);
	}
	double t0 = now();
	for (long i = 1; i <= iters; i++) {
		w[0] = 2 * i - 1;
		while (w[0] != 2 * i)
			;
	}
	double t = now() - t0;
	waitpid(p, NULL, 0);
	munmap((void *)w, 4096);
	return t / iters * 1e9;
}

static double memcpy_mbs(size_t n)
{
	/* Page-aligned buffers: glibc's memmove on some AMD CPUs runs ~10x slower when the
	 * destination sits a few bytes past the source modulo 4 KiB (malloc's 16-byte chunk
	 * offsets can produce that); the limit is the copy at its best. */
	char *a = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
	char *b = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
	memset(a, 1, n);
	memset(b, 2, n);
	long reps = (long)(2e9 / n) + 1;
	double t0 = now();
	for (long i = 0; i < reps; i++) {
		memcpy(i & 1 ? a : b, i & 1 ? b : a, n);
		__asm__ volatile("" ::: "memory");
	}
	double t = now() - t0;
	free(a);
	free(b);
	return n * (double)reps / t / 1e6;
}

int main(int argc, char **argv)
{
	double v[7];
	if (argc >= 2 && !strcmp(argv[1], "rtt")) {
		for (int i = 0; i < 7; i++)
			v[i] = rtt_ns();
		printf("%.1f\n", median(v, 7));
		return 0;
	}
	if (argc >= 3 && !strcmp(argv[1], "memcpy")) {
		for (int i = 0; i < 5; i++)
			v[i] = memcpy_mbs(strtoul(argv[2], NULL, 0));
		printf("%.0f\n", median(v, 5));
		return 0;
	}
	fprintf(stderr, "usage: limits rtt | limits memcpy BYTES\n");
	return 2;
}

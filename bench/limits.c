/*
 * The physical limits vrnic's figures are compared against, measured on this machine
 * (`vrnic bench` compiles this file at run time and runs it; it prints medians):
 *
 *   limits rtt [ITERS]
 *       round trip of a cache-line ping-pong between two processes through shared memory
 *       (the floor for any shared-memory message latency), in ns: the median of 7 runs of
 *       ITERS round trips (default 200000)
 *   limits memcpy [-b BYTES] [-t THREADS] SIZE...
 *       single-thread memcpy bandwidth for SIZE-byte copies between two page-aligned buffers,
 *       hot, in MB/s (1e6): "SIZE MBPS" per line, the median of 5 trials of about BYTES
 *       bytes each (default 2e9; at most 1e7 copies a trial). With THREADS > 1, a working set
 *       of SIZE bytes copied by THREADS processes at once, each its SIZE/THREADS share (at
 *       least a page), started together: the sum of their speeds (the limit of as many engine
 *       threads moving that working set)
 *   limits ring [-n SLOTS] SLOT
 *       slots per second through a single-producer single-consumer ring of SLOT-byte slots
 *       between two processes, in millions: the producer writes each slot and publishes every
 *       8, the consumer copies each slot out and checks it, as an engine takes work requests
 *       from an app's ring; the median of 5 runs of SLOTS slots (default 2e6)
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

static double rtt_ns(long iters)
{
	volatile uint64_t *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
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

static double memcpy_mbs(size_t n, double budget)
{
	/* Page-aligned buffers: glibc's memmove on some AMD CPUs runs ~10x slower when the
	 * destination sits a few bytes past the source modulo 4 KiB (malloc's 16-byte chunk
	 * offsets can produce that); the limit is the copy at its best. */
	char *a = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
	char *b = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
	if (!a || !b) {
		perror("aligned_alloc");
		exit(1);
	}
	memset(a, 1, n);
	memset(b, 2, n);
	long reps = (long)(budget / n) + 1;
	if (reps > 10000000)
		reps = 10000000;
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

/* memcpy_mbs by `threads` processes at once over `n` bytes in all, each its share: the sum. */
static double memcpy_mbs_par(size_t n, double budget, int threads)
{
	if (threads <= 1)
		return memcpy_mbs(n, budget);
	size_t share = (n / (size_t)threads + 4095) & ~(size_t)4095;
	if (share == 0)
		share = 4096;
	size_t len = 4096 + (size_t)threads * sizeof(double);
	char *shm = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (shm == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	volatile int *go = (volatile int *)shm;
	volatile double *res = (volatile double *)(shm + 4096);
	*go = 0;
	for (int t = 0; t < threads; t++) {
		pid_t p = fork();
		if (p < 0) {
			perror("fork");
			exit(1);
		}
		if (p == 0) {
			while (!*go)
				;
			res[t] = memcpy_mbs(share, budget);
			_exit(0);
		}
	}
	usleep(20000);
	*go = 1;
	for (int t = 0; t < threads; t++)
		wait(NULL);
	double sum = 0;
	for (int t = 0; t < threads; t++)
		sum += res[t];
	munmap(shm, len);
	return sum;
}

#define RING 256 /* slots */
#define BATCH 8 /* slots published at once */

struct ring_ctl {
	volatile uint64_t head __attribute__((aligned(64))); /* slots published */
	volatile uint64_t tail __attribute__((aligned(64))); /* slots consumed */
};

static double ring_mslots(size_t slot, long slots)
{
	size_t len = 4096 + RING * slot;
	char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	struct ring_ctl *c = (struct ring_ctl *)m;
	char *ring = m + 4096;
	c->head = c->tail = 0;
	pid_t p = fork();
	if (p == 0) {
		/* The consumer: copies each published slot out and checks its sequence number. */
		char *out = malloc(slot);
		uint64_t tail = 0, head = 0;
		while (tail < (uint64_t)slots) {
			while (head == tail)
				head = __atomic_load_n(&c->head, __ATOMIC_ACQUIRE);
			for (; tail < head; tail++) {
				memcpy(out, ring + (tail % RING) * slot, slot);
				if (*(uint64_t *)out != tail)
					_exit(3);
				if (tail % BATCH == BATCH - 1)
					__atomic_store_n(&c->tail, tail + 1, __ATOMIC_RELEASE);
			}
		}
		_exit(0);
	}
	char *in = malloc(slot);
	memset(in, 0x5a, slot);
	uint64_t tail = 0;
	double t0 = now();
	for (uint64_t i = 0; i < (uint64_t)slots; i++) {
		while (i - tail >= RING - BATCH)
			tail = __atomic_load_n(&c->tail, __ATOMIC_ACQUIRE);
		*(uint64_t *)in = i;
		memcpy(ring + (i % RING) * slot, in, slot);
		if (i % BATCH == BATCH - 1 || i + 1 == (uint64_t)slots)
			__atomic_store_n(&c->head, i + 1, __ATOMIC_RELEASE);
	}
	int status;
	waitpid(p, &status, 0);
	double t = now() - t0;
	free(in);
	munmap(m, len);
	if (!WIFEXITED(status) || WEXITSTATUS(status)) {
		fprintf(stderr, "ring consumer failed\n");
		exit(1);
	}
	return slots / t / 1e6;
}

static int usage(void)
{
	fprintf(stderr, "usage: limits rtt [ITERS] | limits memcpy [-b BYTES] [-t THREADS] SIZE... | limits ring [-n SLOTS] SLOT\n");
	return 2;
}

int main(int argc, char **argv)
{
	double v[7];
	if (argc >= 2 && !strcmp(argv[1], "rtt")) {
		long iters = argc >= 3 ? atol(argv[2]) : 200000;
		if (iters < 1)
			return usage();
		for (int i = 0; i < 7; i++)
			v[i] = rtt_ns(iters);
		printf("%.1f\n", median(v, 7));
		return 0;
	}
	if (argc >= 3 && !strcmp(argv[1], "memcpy")) {
		int a = 2;
		double budget = 2e9;
		int threads = 1;
		if (a + 1 < argc && !strcmp(argv[a], "-b")) {
			budget = atof(argv[a + 1]);
			a += 2;
		}
		if (a + 1 < argc && !strcmp(argv[a], "-t")) {
			threads = atoi(argv[a + 1]);
			a += 2;
		}
		if (a >= argc || budget <= 0 || threads < 1 || threads > 256)
			return usage();
		for (; a < argc; a++) {
			size_t n = strtoul(argv[a], NULL, 0);
			if (!n)
				return usage();
			for (int i = 0; i < 5; i++)
				v[i] = memcpy_mbs_par(n, budget, threads);
			printf("%zu %.0f\n", n, median(v, 5));
			fflush(stdout);
		}
		return 0;
	}
	if (argc >= 3 && !strcmp(argv[1], "ring")) {
		int a = 2;
		long slots = 2000000;
		if (!strcmp(argv[a], "-n") && a + 2 < argc) {
			slots = atol(argv[a + 1]);
			a += 2;
		}
		size_t slot = strtoul(argv[a], NULL, 0);
		if (slot < 8 || slots < 1)
			return usage();
		for (int i = 0; i < 5; i++)
			v[i] = ring_mslots(slot, slots);
		printf("%.2f\n", median(v, 5));
		return 0;
	}
	return usage();
}

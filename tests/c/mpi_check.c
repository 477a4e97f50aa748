/*
 * mpi_check: an MPI program as a user would run on an RDMA cluster, for Open MPI over UCX
 * over a vRNIC (built with mpicc):
 *
 *   mpi_check pingpong     2 ranks: sizes 8 B .. 4 MiB, each byte checked on both sides;
 *                          prints the half round trip per size
 *   mpi_check allreduce    any number of ranks: MPI_Allreduce (sum) of 1 .. 1 Mi doubles,
 *                          the result checked; prints the time of 8-double allreduces
 *
 * Rank 0 prints "OK <check>" per passed check; any rank exits 1 with "FAIL ..." on the first
 * failure (MPI_Abort).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;

static void fail(const char *what, long a, long b)
{
	printf("FAIL rank %d: %s (%ld, %ld)\n", rank, what, a, b);
	fflush(stdout);
	MPI_Abort(MPI_COMM_WORLD, 1);
}

static uint8_t pattern(size_t i, int round, int from)
{
	return (uint8_t)(i * 31 + round * 7 + from * 101 + (i >> 12));
}

static void pingpong(void)
{
	if (size != 2)
		fail("pingpong needs 2 ranks", size, 2);
	size_t max = 4u << 20;
	uint8_t *buf = malloc(max);
	if (!buf)
		fail("malloc", 0, 0);
	int peer = 1 - rank;
	for (size_t n = 8; n <= max; n *= 2) {
		/* Checked rounds: fresh bytes each way, every byte compared. */
		for (int it = 0; it < 3; it++) {
			if (rank == 0) {
				for (size_t i = 0; i < n; i++)
					buf[i] = pattern(i, it, 0);
				MPI_Send(buf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
				MPI_Recv(buf, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				for (size_t i = 0; i < n; i++)
					if (buf[i] != pattern(i, it, 1))
						fail("pong data", (long)n, (long)i);
			} else {
				MPI_Recv(buf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				for (size_t i = 0; i < n; i++)
					if (buf[i] != pattern(i, it, 0))
						fail("ping data", (long)n, (long)i);
				for (size_t i = 0; i < n; i++)
					buf[i] = pattern(i, it, 1);
				MPI_Send(buf, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD);
			}
		}
		/* Timed rounds: the same buffer back and forth, as latency benchmarks do. */
		int iters = n <= 65536 ? 1000 : 50;
		MPI_Barrier(MPI_COMM_WORLD);
		double t0 = MPI_Wtime();
		for (int it = 0; it < iters; it++) {
			if (rank == 0) {
				MPI_Send(buf, (int)n, MPI_BYTE, peer, 3, MPI_COMM_WORLD);
				MPI_Recv(buf, (int)n, MPI_BYTE, peer, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(buf, (int)n, MPI_BYTE, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(buf, (int)n, MPI_BYTE, peer, 4, MPI_COMM_WORLD);
			}
		}
		double half = (MPI_Wtime() - t0) / iters / 2;
		if (rank == 0)
			printf("size %zu half round trip %.2f us\n", n, half * 1e6);
	}
	if (rank == 0)
		printf("OK ping-pong 8 B .. 4 MiB, every byte checked both ways\n");
	free(buf);
}

static void allreduce(void)
{
	int max = 1 << 20;
	double *in = malloc(sizeof(double) * max), *out = malloc(sizeof(double) * max);
	if (!in || !out)
		fail("malloc", 0, 0);
	for (int n = 1; n <= max; n *= 4) {
		for (int i = 0; i < n; i++)
			in[i] = rank * 1000.0 + i;
		MPI_Allreduce(in, out, n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
		for (int i = 0; i < n; i++) {
			double want = 1000.0 * size * (size - 1) / 2 + (double)i * size;
			if (out[i] != want)
				fail("allreduce sum", n, i);
		}
	}
	int iters = 500;
	MPI_Barrier(MPI_COMM_WORLD);
	double t0 = MPI_Wtime();
	for (int it = 0; it < iters; it++)
		MPI_Allreduce(in, out, 8, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
	double t = (MPI_Wtime() - t0) / iters;
	if (rank == 0) {
		printf("allreduce of 8 doubles over %d ranks %.2f us\n", size, t * 1e6);
		printf("OK allreduce over %d ranks, 1 .. 1Mi doubles, sums checked\n", size);
	}
	free(in);
	free(out);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (argc != 2)
		fail("usage: mpi_check pingpong|allreduce", argc, 2);
	if (!strcmp(argv[1], "pingpong"))
		pingpong();
	else if (!strcmp(argv[1], "allreduce"))
		allreduce();
	else
		fail("unknown case", 0, 0);
	MPI_Barrier(MPI_COMM_WORLD);
	MPI_Finalize();
	if (rank == 0)
		printf("OK %s done, finalized\n", argv[1]);
	return 0;
}

/*
 * a2a: MPI_Alltoall of SIZE bytes per rank, ITERS passes, after 200 of 8 B (endpoints
 * connected); prints the first five passes, the median, p90 and min, and what one read of
 * /proc/self/maps costs in this rank.
 *
 *   mpicc -O2 -o a2a a2a.c
 *   a2a [SIZE [ITERS [FRESH]]]    FRESH 1: free and malloc the buffers every pass (glibc hands
 *                                 back the same addresses); 2: mmap new ones every pass
 *                                 (every pass registers fresh buffers)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, np; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &np);
    size_t size = argc > 1 ? strtoul(argv[1], 0, 0) : 262144;
    int iters = argc > 2 ? atoi(argv[2]) : 200;
    int fresh = argc > 3 ? atoi(argv[3]) : 0;   /* 1: malloc fresh buffers each iteration */
    double *t = calloc(iters, sizeof(double));
    char *a = malloc(size * np), *b = malloc(size * np);
    memset(a, 1, size * np); memset(b, 2, size * np);
    { char sa[16], sb[16]; for (int w = 0; w < 200; w++) MPI_Alltoall(sa, 8, MPI_BYTE, sb, 8, MPI_BYTE, MPI_COMM_WORLD); }
    double b0 = MPI_Wtime(); MPI_Barrier(MPI_COMM_WORLD); double b1 = MPI_Wtime(); MPI_Barrier(MPI_COMM_WORLD); double b2 = MPI_Wtime();
    if (rank == 0) printf("barrier 1: %.1f us, barrier 2: %.1f us\n", (b1 - b0) * 1e6, (b2 - b1) * 1e6);
    { /* maps_cost */ char buf[65536]; double m0 = MPI_Wtime(); size_t tot = 0; int lines = 0;
      for (int k = 0; k < 10; k++) { FILE *f = fopen("/proc/self/maps", "r"); size_t n; tot = 0; lines = 0; while ((n = fread(buf, 1, sizeof buf, f)) > 0) { tot += n; for (size_t j = 0; j < n; j++) lines += buf[j] == '\n'; } fclose(f); }
      if (rank == 0) printf("/proc/self/maps: %d lines, %zu bytes, %.1f us per read\n", lines, tot, (MPI_Wtime() - m0) / 10 * 1e6); }
    for (int i = 0; i < iters; i++) {
        if (fresh == 2) { a = mmap(0, size * np, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0); b = mmap(0, size * np, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0); memset(a, i, size * np); memset(b, 0, size*np); }
        else if (fresh) { free(a); free(b); a = malloc(size * np); b = malloc(size * np); memset(a, i, size * np); memset(b, 0, size*np); }
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        MPI_Alltoall(a, size, MPI_BYTE, b, size, MPI_BYTE, MPI_COMM_WORLD);
        t[i] = MPI_Wtime() - t0;
    }
    double first = t[0];
    if (rank == 0) printf("first five: %.1f %.1f %.1f %.1f %.1f us\n", t[0]*1e6, t[1]*1e6, t[2]*1e6, t[3]*1e6, t[4]*1e6);
    qsort(t, iters, sizeof(double), cmp);
    if (rank == 0) printf("alltoall %zu B x %d fresh=%d: first %.1f us, median %.1f us, p90 %.1f us, min %.1f us\n", size, iters, fresh, first * 1e6, t[iters / 2] * 1e6, t[iters * 9 / 10] * 1e6, t[0] * 1e6);
    MPI_Finalize();
    return 0;
}

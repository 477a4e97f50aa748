/*
 * vec: an exchange like PTRANS's on 2 ranks, alone: each rank holds a 500 x 250 column-major matrix of
 * doubles and MPI_Sendrecv's its NB x NB blocks (18 of 80 x 80) with the other, ITERS times;
 * prints the first pass and the median pass (per block, and GB/s both ways).
 *
 *   mpicc -O2 -o vec vec.c
 *   vec [NB [ITERS [CONTIG]]]     CONTIG 1: blocks as contiguous runs (no derived datatype)
 *
 * Run it as hpcc.sh runs hpcc (under `vrnic run -- mpirun ... --mca pml ucx`, or with
 * `--mca pml ob1 --mca btl tcp,self`); add `--bind-to none` to undo Open MPI's binding.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank; MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int m = 500, n = 250, nb = argc > 1 ? atoi(argv[1]) : 80, iters = argc > 2 ? atoi(argv[2]) : 100, contig = argc > 3 ? atoi(argv[3]) : 0;
    double *a = malloc(sizeof(double) * m * n), *b = malloc(sizeof(double) * m * n);
    for (int i = 0; i < m * n; i++) a[i] = i, b[i] = 0;
    MPI_Datatype blk; 
    if (contig) MPI_Type_contiguous(nb * nb, MPI_DOUBLE, &blk); else MPI_Type_vector(nb, nb, m, MPI_DOUBLE, &blk);
    MPI_Type_commit(&blk);
    int peer = 1 - rank, blocks = (m / nb) * (n / nb);
    double *t = calloc(iters, sizeof(double));
    for (int it = 0; it < iters; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int k = 0; k < blocks; k++) {
            int off = contig ? k * nb * nb % (m * n - nb * nb) : (k % (m / nb)) * nb + (k / (m / nb)) * nb * m;
            MPI_Sendrecv(a + off, 1, blk, peer, k, b + off, 1, blk, peer, k, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        }
        t[it] = MPI_Wtime() - t0;
    }
    double first = t[0];
    qsort(t, iters, sizeof(double), cmp);
    if (rank == 0) printf("%d sendrecv of %dx%d-double blocks (%s): first %.0f us, median %.0f us (%.1f us per block, %.2f GB/s)\n", blocks, nb, nb, contig ? "contiguous" : "vector", first * 1e6, t[iters/2] * 1e6, t[iters/2] * 1e6 / blocks, 2.0 * blocks * nb * nb * 8 / t[iters/2] / 1e9);
    MPI_Finalize(); return 0;
}

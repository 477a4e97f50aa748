/*
 * Control-path costs through the driver library (run under `vrnic run`): median time to
 * open the device, register 1 MiB and 1 GiB (fresh anonymous memory, and memory the app has
 * written), and create a QP and bring it to RTS. Prints "name microseconds" lines.
 *
 *   ctrl [RUNS]
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
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

static void die(const char *what)
{
	perror(what);
	exit(1);
}

int main(int argc, char **argv)
{
	int runs = argc > 1 ? atoi(argv[1]) : 5;
	double t[64];
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		die("no device");
	struct ibv_context *ctx = NULL;
	for (int i = 0; i < runs; i++) {
		double t0 = now_us();
		ctx = ibv_open_device(list[0]);
		t[i] = now_us() - t0;
		if (!ctx)
			die("open");
		if (i + 1 < runs)
			ibv_close_device(ctx);
	}
	printf("open_device %.1f\n", median(t, runs));
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_port_attr pa;
	if (!pd || ibv_query_port(ctx, 1, &pa))
		die("pd");
	size_t sizes[] = { 1 << 20, (size_t)1 << 30 };
	const char *names[] = { "1MiB", "1GiB" };
	for (int s = 0; s < 2; s++) {
		for (int touched = 0; touched < 2; touched++) {
			for (int i = 0; i < runs; i++) {
				char *p = mmap(NULL, sizes[s], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
				if (p == MAP_FAILED)
					die("mmap");
				if (touched)
					memset(p, 0x5a, sizes[s]);
				double t0 = now_us();
				struct ibv_mr *mr = ibv_reg_mr(pd, p, sizes[s], IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
				t[i] = now_us() - t0;
				if (!mr)
					die("reg_mr");
				ibv_dereg_mr(mr);
				munmap(p, sizes[s]);
			}
			printf("reg_mr_%s_%s %.1f\n", names[s], touched ? "written" : "fresh", median(t, runs));
		}
	}
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!cq)
		die("cq");
	for (int i = 0; i < runs * 4 && i < 64; i++) {
		struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
					       .cap = { .max_send_wr = 64, .max_recv_wr = 64, .max_send_sge = 1,
							.max_recv_sge = 1 } };
		double t0 = now_us();
		struct ibv_qp *qp = ibv_create_qp(pd, &ia);
		if (!qp)
			die("create_qp");
		struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
					 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
		if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
			die("INIT");
		a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = qp->qp_num,
					  .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
					  .ah_attr = { .dlid = pa.lid, .port_num = 1 } };
		if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
			die("RTR");
		a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
					  .max_rd_atomic = 1 };
		if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					      IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
			die("RTS");
		t[i] = now_us() - t0;
		ibv_destroy_qp(qp);
	}
	printf("create_qp_to_rts %.1f\n", median(t, runs * 4 < 64 ? runs * 4 : 64));
	return 0;
}

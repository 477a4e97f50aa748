/*
 * Holds a vRNIC busy without traffic (run under `vrnic run`): opens the device, makes a PD, a
 * CQ and N RC QPs (default 1, `holdqp N`) in INIT, prints "ready" and waits until its stdin
 * closes (or it is killed). The scale benchmark holds many vRNICs with one QP each; the
 * fairness benchmark and test hold one vRNIC with thousands of idle QPs.
 */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 1;
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0] || n < 1)
		return 1;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx)
		return 2;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_qp **qps = calloc(n, sizeof(*qps));
	if (!pd || !cq || !qps)
		return 3;
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	for (int i = 0; i < n; i++) {
		qps[i] = ibv_create_qp(pd, &ia);
		if (!qps[i])
			return 4;
		if (ibv_modify_qp(qps[i], &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						   IBV_QP_ACCESS_FLAGS))
			return 5;
	}
	printf("ready\n");
	fflush(stdout);
	char c;
	while (read(0, &c, 1) > 0)
		;
	for (int i = 0; i < n; i++)
		ibv_destroy_qp(qps[i]);
	free(qps);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}

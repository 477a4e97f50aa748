/*
 * Holds one vRNIC busy for the scale benchmark (run under `vrnic run`): opens the device,
 * makes a PD, a CQ and an RC QP, moves it to INIT, prints "ready" and waits until its stdin
 * closes (or it is killed).
 */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <unistd.h>

int main(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		return 1;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx)
		return 2;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!pd || !cq)
		return 3;
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 64, .max_recv_wr = 64, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!qp)
		return 4;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		return 5;
	printf("ready\n");
	fflush(stdout);
	char c;
	while (read(0, &c, 1) > 0)
		;
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}

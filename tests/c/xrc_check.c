/*
 * xrc_check.c: XRC from two processes, each on its own vRNIC.
 *
 * The server opens two XRC domains (one by a file, one private), makes an XRC SRQ in each
 * (each on its own CQ), an XRC receive QP in the first, and an MR for RDMA WRITE. The
 * client makes an XRC send QP with ibv_create_qp_ex and SEND_OPS_FLAGS, connects it to the
 * server's receive QP, and through ibv_wr_* with ibv_wr_set_xrc_srqn:
 *   - sends to SRQ 1: the bytes land in SRQ 1's receive, which completes on SRQ 1's CQ with
 *     the receive QP's number;
 *   - writes into the MR (SRQ 1's PD): the bytes land;
 *   - sends to SRQ 2, of the other domain: IBV_WC_REM_INV_REQ_ERR, SRQ 2's receive stays
 *     posted and nothing lands.
 * Also: ibv_get_srq_num numbers, IBV_DEVICE_XRC reported, ibv_open_xrcd's errnos, and
 * ibv_close_xrcd EBUSY while an SRQ or the receive QP uses the domain, 0 after.
 *
 * Usage: xrc_check server PORT | xrc_check client HOST PORT. Prints "OK ..." per check, then
 * "xrc done"; "FAIL ..." and exit 1 on the first failure.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "exchange.h"

#define LEN 4096
#define POLL_SECONDS 20

struct info {
	uint32_t lid, qpn, srqn1, srqn2, rkey, pad;
	uint64_t addr;
};

static void say(int sock, uint32_t v) { xfer(sock, &v, 4, 1); }
static uint32_t hear(int sock) { uint32_t v; xfer(sock, &v, 4, 0); return v; }

static struct ibv_context *open_dev(void)
{
	struct ibv_device **l = ibv_get_device_list(NULL);
	if (!l || !l[0])
		fail("no device");
	struct ibv_context *c = ibv_open_device(l[0]);
	if (!c)
		fail("open device");
	ibv_free_device_list(l);
	return c;
}

static int poll1(struct ibv_cq *cq, struct ibv_wc *wc)
{
	double end = now() + POLL_SECONDS;
	while (now() < end) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			fail("poll_cq");
		if (n)
			return 1;
	}
	return 0;
}

static void to_init(struct ibv_qp *qp, int acc)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = acc };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify to INIT");
}

static void server(const char *port)
{
	struct ibv_context *ctx = open_dev();
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da) || !(da.device_cap_flags & IBV_DEVICE_XRC))
		fail("IBV_DEVICE_XRC not reported");
	ok("IBV_DEVICE_XRC reported");

	struct ibv_xrcd_init_attr xa = { .comp_mask = IBV_XRCD_INIT_ATTR_FD, .fd = -1 };
	errno = 0;
	if (ibv_open_xrcd(ctx, &xa) || errno != EINVAL)
		fail("open_xrcd without OFLAGS: not EINVAL");
	char path[] = "/tmp/vrnic-xrc-XXXXXX";
	int fd = mkstemp(path);
	if (fd < 0)
		fail("mkstemp");
	unlink(path);
	xa = (struct ibv_xrcd_init_attr){ .comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS,
					  .fd = fd, .oflags = 0 };
	errno = 0;
	if (ibv_open_xrcd(ctx, &xa) || errno != EINVAL)
		fail("open_xrcd of a new file without O_CREAT: not EINVAL");
	xa.oflags = O_CREAT;
	struct ibv_xrcd *x1 = ibv_open_xrcd(ctx, &xa);
	if (!x1)
		fail("open_xrcd O_CREAT");
	xa.oflags = O_CREAT | O_EXCL;
	errno = 0;
	if (ibv_open_xrcd(ctx, &xa) || errno != EINVAL)
		fail("open_xrcd O_EXCL of an existing domain: not EINVAL");
	xa.fd = -1;
	xa.oflags = O_CREAT;
	struct ibv_xrcd *x2 = ibv_open_xrcd(ctx, &xa);
	if (!x2)
		fail("open_xrcd fd -1");
	ok("open_xrcd: EINVAL without OFLAGS, without O_CREAT, with O_EXCL; by file and private");

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq1 = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	struct ibv_cq *cq2 = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	uint8_t *buf = calloc(1, 3 * LEN);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 3 * LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!pd || !cq1 || !cq2 || !buf || !mr)
		fail("pd, cqs, mr");
	struct ibv_srq *srq[2];
	struct ibv_srq_init_attr_ex sa = {
		.attr = { .max_wr = 4, .max_sge = 1 },
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ |
			     IBV_SRQ_INIT_ATTR_PD,
		.srq_type = IBV_SRQT_XRC, .pd = pd,
	};
	struct ibv_srq_init_attr_ex bad = sa;
	bad.comp_mask &= ~IBV_SRQ_INIT_ATTR_CQ;
	bad.xrcd = x1;
	errno = 0;
	if (ibv_create_srq_ex(ctx, &bad) || errno != EINVAL)
		fail("XRC SRQ without a CQ: not EINVAL");
	for (int i = 0; i < 2; i++) {
		sa.xrcd = i ? x2 : x1;
		sa.cq = i ? cq2 : cq1;
		srq[i] = ibv_create_srq_ex(ctx, &sa);
		if (!srq[i])
			fail("create XRC SRQ %d", i);
	}
	uint32_t n1, n2;
	if (ibv_get_srq_num(srq[0], &n1) || ibv_get_srq_num(srq[1], &n2) || n1 == n2 || !n1 || !n2 ||
	    n1 > 0xffffff || n2 > 0xffffff)
		fail("get_srq_num: %u %u", n1, n2);
	ok("XRC SRQs in two domains, numbers %u and %u", n1, n2);

	struct ibv_qp_init_attr_ex qa = { .qp_type = IBV_QPT_XRC_RECV, .comp_mask = IBV_QP_INIT_ATTR_XRCD,
					  .xrcd = x1 };
	struct ibv_qp *rq = ibv_create_qp_ex(ctx, &qa);
	if (!rq || rq->qp_type != IBV_QPT_XRC_RECV)
		fail("create XRC receive QP");
	to_init(rq, IBV_ACCESS_REMOTE_WRITE);
	errno = 0;
	if (ibv_close_xrcd(x1) != EBUSY)
		fail("close_xrcd while its SRQ and QP exist: not EBUSY");
	ok("close_xrcd EBUSY while used");

	for (int i = 0; i < 2; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf + i * LEN, .length = LEN, .lkey = mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 }, *b;
		if (ibv_post_srq_recv(srq[i], &w, &b))
			fail("post_srq_recv %d", i);
	}
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		fail("query_port");
	int sock = listen_on(port);
	struct info me = { .lid = pa.lid, .qpn = rq->qp_num, .srqn1 = n1, .srqn2 = n2,
			   .rkey = mr->rkey, .addr = (uintptr_t)buf + 2 * LEN }, peer;
	xfer(sock, &me, sizeof me, 1);
	xfer(sock, &peer, sizeof peer, 0);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = peer.qpn,
				 .rq_psn = 7, .min_rnr_timer = 12, .max_dest_rd_atomic = 1,
				 .ah_attr = { .dlid = peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(rq, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("receive QP to RTR");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.sq_psn = 9;
	a.retry_cnt = 7;
	errno = 0;
	if (!ibv_modify_qp(rq, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN | IBV_QP_RETRY_CNT))
		fail("receive QP to RTS with RETRY_CNT accepted");
	if (ibv_modify_qp(rq, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN))
		fail("receive QP to RTS");
	ok("receive QP: RTR, RTS with TIMEOUT and SQ_PSN only");
	say(sock, 1);

	/* The client's SEND to SRQ 1 and its WRITE. */
	struct ibv_wc wc;
	if (!poll1(cq1, &wc))
		fail("no completion on SRQ 1's CQ");
	if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 100 || wc.opcode != IBV_WC_RECV || wc.byte_len != 1000 ||
	    wc.qp_num != rq->qp_num)
		fail("SRQ 1 receive: status %d wr_id %lu opcode %d len %u qp_num %u (receive QP %u)", wc.status,
		     (unsigned long)wc.wr_id, wc.opcode, wc.byte_len, wc.qp_num, rq->qp_num);
	for (int i = 0; i < 1000; i++)
		if (buf[i] != (uint8_t)(i * 7 + 1))
			fail("SRQ 1 receive byte %d is %u", i, buf[i]);
	ok("send to SRQ 1: 1000 exact bytes, completed on its CQ with the receive QP's number");
	if (hear(sock) != 2)
		fail("sync 2");
	for (int i = 0; i < 500; i++)
		if (buf[2 * LEN + i] != (uint8_t)(i ^ 0x3c))
			fail("written byte %d is %u", i, buf[2 * LEN + i]);
	ok("RDMA WRITE over XRC: 500 exact bytes");
	/* The client's SEND to SRQ 2 (another domain) was refused. */
	if (hear(sock) != 3)
		fail("sync 3");
	if (ibv_poll_cq(cq2, 1, &wc) != 0)
		fail("SRQ 2 (another domain) got a completion");
	for (int i = 0; i < LEN; i++)
		if (buf[LEN + i])
			fail("SRQ 2's buffer changed at %d", i);
	ok("send to SRQ 2 of another domain: nothing landed, nothing completed");

	if (ibv_destroy_qp(rq))
		fail("destroy receive QP");
	if (ibv_close_xrcd(x1) != EBUSY)
		fail("close_xrcd while its SRQ exists: not EBUSY");
	if (ibv_destroy_srq(srq[0]) || ibv_destroy_srq(srq[1]))
		fail("destroy SRQs");
	if (ibv_close_xrcd(x1) || ibv_close_xrcd(x2))
		fail("close_xrcd after its objects are gone");
	ok("close_xrcd: EBUSY with an SRQ left, 0 once empty");
	say(sock, 4);
	printf("xrc done\n");
}

static void client(const char *host, const char *port)
{
	struct ibv_context *ctx = open_dev();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	uint8_t *buf = calloc(1, LEN);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, LEN, IBV_ACCESS_LOCAL_WRITE);
	if (!pd || !cq || !buf || !mr)
		fail("pd, cq, mr");
	for (int i = 0; i < 1000; i++)
		buf[i] = (uint8_t)(i * 7 + 1);
	for (int i = 0; i < 500; i++)
		buf[2048 + i] = (uint8_t)(i ^ 0x3c);
	struct ibv_qp_init_attr_ex qa = {
		.send_cq = cq, .qp_type = IBV_QPT_XRC_SEND,
		.cap = { .max_send_wr = 8, .max_send_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &qa);
	struct ibv_qp_ex *x = qp ? ibv_qp_to_qp_ex(qp) : NULL;
	if (!qp || !x)
		fail("create XRC send QP with SEND_OPS_FLAGS");
	struct ibv_recv_wr rw = { .wr_id = 1 }, *rb;
	if (ibv_post_recv(qp, &rw, &rb) != EINVAL)
		fail("post_recv on an XRC send QP: not EINVAL");
	to_init(qp, 0);
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		fail("query_port");
	int sock = connect_to(host, port);
	struct info me = { .lid = pa.lid, .qpn = qp->qp_num }, peer;
	xfer(sock, &peer, sizeof peer, 0);
	xfer(sock, &me, sizeof me, 1);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = peer.qpn,
				 .rq_psn = 9, .ah_attr = { .dlid = peer.lid, .port_num = 1 } };
	int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
	errno = 0;
	if (!ibv_modify_qp(qp, &a, rtr | IBV_QP_MIN_RNR_TIMER))
		fail("send QP to RTR with MIN_RNR_TIMER accepted");
	if (ibv_modify_qp(qp, &a, rtr))
		fail("send QP to RTR");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 7;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN | IBV_QP_RETRY_CNT |
					  IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("send QP to RTS");
	ok("send QP: RTR with the path only, RTS as RC");
	if (hear(sock) != 1)
		fail("sync 1");

	struct ibv_wc wc;
	ibv_wr_start(x);
	x->wr_id = 11;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_xrc_srqn(x, peer.srqn1);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)buf, 1000);
	x->wr_id = 12;
	ibv_wr_rdma_write(x, peer.rkey, peer.addr);
	ibv_wr_set_xrc_srqn(x, peer.srqn1);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)buf + 2048, 500);
	if (ibv_wr_complete(x))
		fail("wr_complete");
	for (uint64_t id = 11; id <= 12; id++) {
		if (!poll1(cq, &wc) || wc.status != IBV_WC_SUCCESS || wc.wr_id != id)
			fail("completion %lu: status %d wr_id %lu", (unsigned long)id, wc.status,
			     (unsigned long)wc.wr_id);
	}
	ok("wr_send and wr_rdma_write with wr_set_xrc_srqn: both complete");
	say(sock, 2);

	/* To the SRQ of another domain, through the same receive QP. */
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
	struct ibv_send_wr w = { .wr_id = 13, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED }, *b;
	w.qp_type.xrc.remote_srqn = peer.srqn2;
	if (ibv_post_send(qp, &w, &b))
		fail("post_send to SRQ 2");
	if (!poll1(cq, &wc) || wc.wr_id != 13 || wc.status != IBV_WC_REM_INV_REQ_ERR)
		fail("send to another domain's SRQ: status %d (want REM_INV_REQ_ERR %d)", wc.status,
		     IBV_WC_REM_INV_REQ_ERR);
	ok("ibv_post_send to an SRQ of another domain: IBV_WC_REM_INV_REQ_ERR");
	say(sock, 3);
	if (hear(sock) != 4)
		fail("sync 4");
	ibv_destroy_qp(qp);
	printf("xrc done\n");
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 3 && !strcmp(argv[1], "server"))
		server(argv[2]);
	else if (argc >= 4 && !strcmp(argv[1], "client"))
		client(argv[2], argv[3]);
	else
		fail("usage: xrc_check server PORT | client HOST PORT");
	return 0;
}
